"""Settings precedence (defaults < file < env < flags), model specs, the CLI flags, and the
errors for settings that cannot be used: one line each, naming the flag, variable or file."""

from __future__ import annotations

import importlib.metadata
import os
import pickle
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from logprob_service import __version__
from logprob_service.cli import SERVER_MODULES, build_parser, main, settings_from_args
from logprob_service.settings.errors import StartupError
from logprob_service.settings.model import Settings, load_settings
from logprob_service.settings.sources import ENV_ONLY_SETTINGS, parse_model_specs


def test_defaults_serve_the_builtin_model_on_loopback():
    s = load_settings()
    assert s.models == {"default": "builtin:tiny-llama"}
    assert (s.host, s.port, s.device, s.dtype) == ("127.0.0.1", 50051, "auto", "auto")
    assert s.lm_head_chunk_bytes == 256 * 1024**2
    assert s.max_message_bytes > 4 * 1024**2  # raised above gRPC's default
    assert s.metrics_port not in (9090, 9100, 9400, 9464, 8080)  # Prometheus, node, DCGM, OTel exporters


def test_precedence_file_then_env_then_flags(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("port: 6000\nmax_batch_tokens: 99\nlog_level: DEBUG\n")
    assert load_settings(config).port == 6000
    monkeypatch.setenv("LOGPROB_PORT", "7000")
    monkeypatch.setenv("LOGPROB_MAX_BATCH_TOKENS", "77")
    s = load_settings(config, max_batch_tokens=5)
    assert (s.port, s.max_batch_tokens, s.log_level) == (7000, 5, "DEBUG")


def test_cli_flags_override_env_and_file(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("models:\n  ref: builtin:tiny-llama\nport: 6000\n")
    (tmp_path / "ref").mkdir()
    (tmp_path / "policy").mkdir()
    monkeypatch.setenv("LOGPROB_CONFIG", str(config))
    monkeypatch.setenv("LOGPROB_DEVICE", "cpu")
    flags = f"serve --model ref={tmp_path}/ref --model policy={tmp_path}/policy --port 6001 --dtype bfloat16"
    args = build_parser().parse_args([*flags.split(), "--trust-remote-code"])
    s = settings_from_args(args)
    assert s.models == {"ref": f"{tmp_path}/ref", "policy": f"{tmp_path}/policy"}
    assert (s.port, s.dtype, s.device, s.trust_remote_code) == (6001, "bfloat16", "cpu", True)


def test_every_setting_has_a_flag_and_a_description():
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings}
    for name, field in Settings.model_fields.items():
        flag = "--model" if name == "models" else "--" + name.replace("_", "-")
        assert (flag not in flags) if name in ENV_ONLY_SETTINGS else (flag in flags), name
        assert field.description, name


def test_secrets_come_from_the_environment_never_a_flag(monkeypatch):
    assert ENV_ONLY_SETTINGS == {"auth_tokens"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--auth-tokens", "x" * 20])
    monkeypatch.setenv("LOGPROB_AUTH_TOKENS", "tokens: []")
    s = load_settings()
    assert s.auth_tokens.get_secret_value() == "tokens: []"
    assert "tokens: []" not in repr(s) and "tokens: []" not in str(s.model_dump())


def test_tls_files_go_together(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(StartupError, match="--tls-cert-file and --tls-key-file must be set together"):
        load_settings(tls_cert_file=pem)
    with pytest.raises(StartupError, match="--tls-client-ca-file"):
        load_settings(tls_client_ca_file=pem)
    with pytest.raises(StartupError, match=r"--tls-key-file .*missing\.pem: Path does not point to a file"):
        load_settings(tls_cert_file=pem, tls_key_file=tmp_path / "missing.pem")
    s = load_settings(tls_cert_file=pem, tls_key_file=pem, tls_client_ca_file=pem)
    assert s.tls_client_ca_file == pem


@pytest.mark.parametrize(
    "value,expected",
    [
        ("a=builtin:tiny-llama,b=/x", {"a": "builtin:tiny-llama", "b": "/x"}),
        ('{"a": "/x"}', {"a": "/x"}),
        (["a=/x", "b=c=d"], {"a": "/x", "b": "c=d"}),
        ({"ref": "org/model"}, {"ref": "org/model"}),
    ],
)
def test_model_specs(value, expected):
    assert parse_model_specs(value) == expected


@pytest.mark.parametrize("value", [["a=/x", "a=/y"], ["=x"], ["a="], ["/x"], ["ref"], {"ref": None}])
def test_bad_model_specs(value):
    with pytest.raises(ValueError):
        parse_model_specs(value)


def test_env_models(monkeypatch, tmp_path):
    monkeypatch.setenv("LOGPROB_MODELS", f"ref=builtin:tiny-llama,policy={tmp_path}")
    assert load_settings().models == {"ref": "builtin:tiny-llama", "policy": str(tmp_path)}


@pytest.mark.parametrize(
    "overrides,named",
    [
        ({"max_batch_tokens": 0}, "--max-batch-tokens 0: Input should be greater than or equal to 1"),
        ({"dtype": "int8"}, "--dtype int8: Input should be 'auto', 'float32'"),
        ({"bogus": 1}, "bogus is not a setting"),
        ({"max_tokens_per_request": 10, "max_queued_tokens": 5}, "must not exceed --max-queued-tokens (5)"),
        (
            {"max_tokens_per_request": 10, "max_queued_tokens_per_client": 5},
            "must not exceed --max-queued-tokens-per-client (5)",
        ),
        ({"max_concurrent_rpcs_per_connection": 0}, "--max-concurrent-rpcs-per-connection 0: "),
        ({"models": {}}, "--model: at least one model must be served"),
    ],
)
def test_invalid_settings_name_the_flag(overrides, named):
    with pytest.raises(StartupError) as info:
        load_settings(**overrides)
    assert named in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(StartupError, match=r"config file .*nope\.yaml \(--config\): No such file"):
        load_settings(tmp_path / "nope.yaml")


def test_serve_help_lists_every_flag(capsys):
    """argparse formats help texts with %: a setting whose description has a literal % once broke --help."""
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["serve", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for name in Settings.model_fields:
        if name != "models" and name not in ENV_ONLY_SETTINGS:
            assert "--" + name.replace("_", "-") in shown, name


def test_malformed_config_file_names_the_file_line_and_column(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: 6000\nhost: [\n")
    with pytest.raises(StartupError, match=rf"config file {config}, line 3, column 1 \(--config\): not valid YAML"):
        load_settings(config)
    config.write_bytes(b"host: \xff\n")
    with pytest.raises(StartupError, match=r"c\.yaml \(--config\): not UTF-8 text \(byte 6\)"):
        load_settings(config)
    config.write_text("- port\n")
    with pytest.raises(
        StartupError, match=r"c\.yaml \(--config\): expected settings \(name: value\), found \['port'\]"
    ):
        load_settings(config)


def test_config_file_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGPROB_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(StartupError, match=r"missing\.yaml \(LOGPROB_CONFIG\): No such file"):
        load_settings()
    monkeypatch.setenv("LOGPROB_CONFIG", "")  # names no file
    assert load_settings().port == 50051


def test_a_typo_in_the_environment_is_refused_as_in_the_file(tmp_path, monkeypatch):
    """``LOGPROB_MAX_BATCH_TOKENZ=5`` was ignored without a word, leaving the default."""
    config = tmp_path / "c.yaml"
    config.write_text("max_batch_tokenz: 5\n")
    with pytest.raises(StartupError, match=r"max_batch_tokenz in .*c\.yaml is not a setting; did you mean max_batch"):
        load_settings(config)
    monkeypatch.setenv("LOGPROB_MAX_BATCH_TOKENZ", "5")
    with pytest.raises(StartupError) as info:
        load_settings()
    assert str(info.value) == (
        "LOGPROB_MAX_BATCH_TOKENZ is not a setting; did you mean LOGPROB_MAX_BATCH_TOKENS (--max-batch-tokens)?"
    )


def test_logprob_variables_that_are_not_settings_pass(monkeypatch):
    for name in ("LOGPROB_TEST_SEED", "LOGPROB_MODELS_DIR", "LOGPROB_KEEP_IMAGE"):
        monkeypatch.setenv(name, "1")
    assert load_settings().port == 50051
    monkeypatch.setenv("LOGPROB_NO_SUCH_THING", "1")
    with pytest.raises(StartupError, match="LOGPROB_NO_SUCH_THING is not a setting; logprob-service serve --help"):
        load_settings()


def test_errors_name_the_variable_or_the_file_the_value_came_from(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("max_batch_tokens: 0\nmax_queued_tokens: 5\n")
    with pytest.raises(StartupError) as info:
        load_settings(config)
    assert f"max_batch_tokens: 0 in {config} (--max-batch-tokens): Input should be greater" in str(info.value)
    monkeypatch.setenv("LOGPROB_MAX_BATCH_TOKENS", "0")
    with pytest.raises(StartupError, match=r"^LOGPROB_MAX_BATCH_TOKENS=0 \(--max-batch-tokens\): Input should be"):
        load_settings()
    monkeypatch.setenv("LOGPROB_MAX_BATCH_TOKENS", "7")
    # A check of several settings together names those that did not come from flags.
    with pytest.raises(StartupError) as info:
        load_settings(config, max_tokens_per_request=10)
    assert str(info.value) == (
        "--max-tokens-per-request (10) must not exceed --max-queued-tokens (5): a request larger than the queue "
        f"could never be admitted (from max_queued_tokens: 5 in {config})"
    )


def test_model_paths_that_do_not_exist_are_refused(tmp_path):
    """A missing path was taken as a hub id: ``Repo id must be in the form ...``, never "not found"."""
    with pytest.raises(StartupError) as info:
        load_settings(models=["ref=/models/does-not-exist", f"policy=ref+{tmp_path}/no-adapter"])
    assert str(info.value).splitlines() == [
        "model 'ref': /models/does-not-exist not found (--model)",
        f"model 'policy': LoRA adapter directory {tmp_path}/no-adapter not found (--model)",
    ]
    for source in ("./nope", "../nope", "~/nope-for-logprob-tests", "a/b/c"):
        with pytest.raises(StartupError, match="not found"):
            load_settings(models=[f"ref={source}"])
    # Hub ids and builtins are not paths: they are looked up when loaded.
    for source in ("Qwen/Qwen2.5-0.5B", "gpt2", "builtin:tiny-llama"):
        assert load_settings(models=[f"ref={source}"]).models == {"ref": source}
    assert load_settings(models=[f"ref={tmp_path}", f"policy=ref+{tmp_path}"]).models["policy"] == f"ref+{tmp_path}"


@pytest.mark.parametrize("spelling", ["{a}, {b}", "{a},{b},", '["{a}", "{b}"]'])
def test_list_settings_are_spelled_alike(spelling, tmp_path, monkeypatch):
    """http_trusted_proxies and load_weights_roots read a variable's list with one parser."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    monkeypatch.setenv("LOGPROB_HTTP_TRUSTED_PROXIES", spelling.format(a="10.0.0.1", b="10.1.0.0/16"))
    monkeypatch.setenv("LOGPROB_LOAD_WEIGHTS_ROOTS", spelling.format(a=a, b=b))
    settings = load_settings()
    assert settings.http_trusted_proxies == ("10.0.0.1", "10.1.0.0/16")
    assert settings.load_weights_roots == (a.resolve(), b.resolve())


def test_settings_from_a_config_file_pickle(tmp_path):
    """Weight receivers and tensor-parallel ranks get a pickled copy: a config file's settings
    were of a class local to load_settings, which does not pickle."""
    config = tmp_path / "c.yaml"
    config.write_text("port: 6000\n")
    settings = load_settings(config)
    assert type(settings) is Settings and pickle.loads(pickle.dumps(settings)) == settings
    assert settings.port == 6000 and settings.model_fields_set == {"port"}


@pytest.mark.parametrize(
    "argv,env,line",
    [
        (["serve", "--model", "ref"], {}, "logprob-service: --model: 'ref' is not NAME=SOURCE, e.g. ref="),
        (
            ["serve", "--model", "ref=/models/does-not-exist"],
            {},
            "logprob-service: model 'ref': /models/does-not-exist not found (--model)",
        ),
        (["serve", "--max-batch-tokens", "0"], {}, "logprob-service: --max-batch-tokens 0: Input should be greater"),
        (["serve"], {"LOGPROB_MAX_BATCH_TOKENZ": "5"}, "logprob-service: LOGPROB_MAX_BATCH_TOKENZ is not a setting"),
        (["serve"], {"LOGPROB_MODELS": "ref"}, "logprob-service: LOGPROB_MODELS=ref (--model): 'ref' is not NAME="),
    ],
)
def test_cli_setting_errors_are_one_line_and_exit_2(argv, env, line, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def test_cli_malformed_config_file_exits_2(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("host: [\n")
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == f"logprob-service: config file {config}, line 2, column 1 (--config): not valid YAML: " + (
        "expected the node content, but found '<stream end>'\n"
    )


@pytest.mark.parametrize(
    "argv,error",
    [
        (
            ["serve", "--max-batch-tokenz", "5"],
            "unrecognized arguments: --max-batch-tokenz (did you mean --max-batch-tokens?)",
        ),
        (
            ["serve", "--auth-tokens", "SECRET"],
            "unrecognized arguments: --auth-tokens (--auth-tokens is environment only",
        ),
        (["serve", "--max-batch-tokens", "x"], "argument --max-batch-tokens: invalid int value: 'x'"),
    ],
)
def test_cli_usage_errors_are_the_error_and_a_one_line_hint(argv, error, capsys):
    """argparse printed 40 lines of usage before the error."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"logprob-service serve: error: {error}") and "SECRET" not in lines[0], lines
    assert lines[1:] == ["usage: logprob-service serve [flags]; logprob-service serve --help lists them"]


ROOT = Path(__file__).resolve().parents[2]


def test_without_the_server_extra_the_command_says_what_to_install():
    """The base (client-only) install has the command too: it crashed with ``ModuleNotFoundError:
    No module named 'pydantic'``. A missing module is simulated: ``None`` in sys.modules."""
    code = (
        "import sys; sys.modules['pydantic'] = sys.modules['torch'] = None; "
        "sys.argv = ['logprob-service', 'serve', '--help']; "
        "from logprob_service.cli import main; sys.exit(main())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "client")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "logprob-service serve needs the server extra: from a checkout of logprob-service, pip install '.[server]' "
        f"(or its wheel: pip install 'logprob_service-{__version__}-py3-none-any.whl[server]'; docs/deployment.md) "
        "(not installed: torch, pydantic)\n"
    )


def test_the_server_modules_checked_are_those_of_the_server_extra():
    """SERVER_MODULES lists the extra's packages by module name: every package of the extra is
    one of them (a package added to the extra and not here would go unchecked)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["server"]

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    required = {normal(re.match(r"[A-Za-z0-9._-]+", requirement)[0]) for requirement in extra}
    installed = importlib.metadata.packages_distributions()
    checked = {normal(dist) for module in SERVER_MODULES for dist in installed.get(module, [])}
    assert required <= checked, required - checked
