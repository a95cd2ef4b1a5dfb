"""Settings precedence (defaults < file < env < flags), model specs, and the CLI flags."""

from __future__ import annotations

import pytest
from logprob_service.cli import build_parser, settings_from_args
from logprob_service.config import ENV_ONLY_SETTINGS, Settings, load_settings, parse_model_specs
from pydantic import ValidationError


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
    monkeypatch.setenv("LOGPROB_CONFIG", str(config))
    monkeypatch.setenv("LOGPROB_DEVICE", "cpu")
    flags = "serve --model ref=/ckpt/ref --model /ckpt/policy --port 6001 --dtype bfloat16 --trust-remote-code"
    args = build_parser().parse_args(flags.split())
    s = settings_from_args(args)
    assert s.models == {"ref": "/ckpt/ref", "default": "/ckpt/policy"}
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
    with pytest.raises(ValidationError, match="tls_cert_file and tls_key_file must be set together"):
        load_settings(tls_cert_file=pem)
    with pytest.raises(ValidationError, match="tls_client_ca_file"):
        load_settings(tls_client_ca_file=pem)
    with pytest.raises(ValidationError, match="tls_key_file"):
        load_settings(tls_cert_file=pem, tls_key_file=tmp_path / "missing.pem")
    s = load_settings(tls_cert_file=pem, tls_key_file=pem, tls_client_ca_file=pem)
    assert s.tls_client_ca_file == pem


@pytest.mark.parametrize(
    "value,expected",
    [
        ("a=builtin:tiny-llama,b=/x", {"a": "builtin:tiny-llama", "b": "/x"}),
        ('{"a": "/x"}', {"a": "/x"}),
        (["/x"], {"default": "/x"}),
        ({"ref": "org/model"}, {"ref": "org/model"}),
    ],
)
def test_model_specs(value, expected):
    assert parse_model_specs(value) == expected


@pytest.mark.parametrize("value", [["a=/x", "a=/y"], ["=x"], ["a="]])
def test_bad_model_specs(value):
    with pytest.raises(ValueError):
        parse_model_specs(value)


def test_env_models(monkeypatch):
    monkeypatch.setenv("LOGPROB_MODELS", "ref=builtin:tiny-llama,policy=/ckpt")
    assert load_settings().models == {"ref": "builtin:tiny-llama", "policy": "/ckpt"}


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        ({"dtype": "int8"}, "dtype"),
        ({"bogus": 1}, "bogus"),
        ({"max_tokens_per_request": 10, "max_queued_tokens": 5}, "max_queued_tokens"),
        ({"max_tokens_per_request": 10, "max_queued_tokens_per_client": 5}, "max_queued_tokens_per_client"),
        ({"max_concurrent_rpcs_per_connection": 0}, "max_concurrent_rpcs_per_connection"),
        ({"models": {}}, "models"),
    ],
)
def test_invalid_settings_name_the_field(overrides, field):
    with pytest.raises(ValidationError) as info:
        load_settings(**overrides)
    assert field in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
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
