"""The layer contracts (`make lint`, ``[tool.importlinter]`` in pyproject.toml) cover every module.

A layer is a package, so a module added inside one is held by its layer's contracts. The modules
at the top of ``logprob_service`` that belong to no layer (settings, domain objects, errors, logs)
are named one by one in the contracts; these tests fail when a module is added there but not
classified, or when a contract that must cover every module but a few leaves one out.
"""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import logprob_service

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
PACKAGE = "logprob_service"


def contracts() -> dict[str, dict]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    return {c["name"]: c for c in config["contracts"]}


def top_level_modules() -> set[str]:
    """Every module and package directly under ``logprob_service``, by full name."""
    return {f"{PACKAGE}.{m.name}" for m in pkgutil.iter_modules(logprob_service.__path__) if m.name != "__main__"}


def layers() -> set[str]:
    contract = contracts()["Server layers: each imports only the layers below it"]
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def common() -> set[str]:
    return set(contracts()["Common modules import no layer"]["source_modules"])


def test_every_top_level_module_is_a_layer_or_a_common_module_and_not_both():
    modules = top_level_modules()
    assert layers() | common() == modules, (
        f"classify in pyproject's contracts: {sorted(modules - layers() - common())}; "
        f"named but missing: {sorted((layers() | common()) - modules)}"
    )
    assert not layers() & common()


def test_common_modules_may_import_no_layer():
    assert set(contracts()["Common modules import no layer"]["forbidden_modules"]) == layers()


def test_only_the_edge_and_start_up_see_grpc_and_only_observability_sees_prometheus():
    grpc_free = set(contracts()["Only the gRPC edge sees gRPC and protobuf"]["source_modules"])
    assert grpc_free == top_level_modules() - {f"{PACKAGE}.{m}" for m in ("cli", "startup", "api")}
    prometheus_free = set(contracts()["Only observability imports prometheus-client"]["source_modules"])
    assert prometheus_free == top_level_modules() - {f"{PACKAGE}.observability"}
