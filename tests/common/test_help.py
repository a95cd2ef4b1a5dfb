"""`serve --help` and docs/configuration.md a newcomer can scan: the settings in groups (models,
network, security, limits, weights, performance, advanced), in the same order in both."""

from __future__ import annotations

import re
from pathlib import Path

from logprob_service.cli import SETTING_GROUPS, build_parser, grouped_settings
from logprob_service.settings.model import Settings

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["models", "network", "security", "limits", "weights", "performance", "advanced"]


def serve_help() -> str:
    return build_parser().commands["serve"].format_help()


def test_serve_help_lists_the_settings_in_groups_models_first():
    text = serve_help()
    headings = re.findall(r"^([a-z]+):$", text, flags=re.MULTILINE)
    assert headings == ["options", *ORDER], headings
    assert text.startswith("usage: logprob-service serve [flags]\n")  # not 50 lines of flags first
    # Where to listen and what to serve come before the weight-update internals.
    assert text.index("--model NAME=SOURCE") < text.index("--host") < text.index("--update-staging-reserve-bytes")


def test_the_model_flag_names_the_lora_form():
    assert "BASE+ADAPTER_DIR" in serve_help()


def test_every_setting_is_in_one_group_and_every_group_names_settings():
    names = list(Settings.model_fields)
    grouped = [name for _, _, members in grouped_settings(names) for name in members]
    assert sorted(grouped) == sorted(names)  # each once; one no group names goes to "advanced"
    listed = [name for _, members in SETTING_GROUPS.values() for name in members]
    assert set(listed) <= set(names), set(listed) - set(names)  # no stale name
    assert list(SETTING_GROUPS) == ORDER
    (*_, (last, _, members)) = grouped_settings([*names, "a_setting_added_later"])
    assert last == "advanced" and members[-1] == "a_setting_added_later"


def test_the_configuration_reference_has_the_same_groups_in_the_same_order():
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert re.findall(r"^## ([a-z]+): ", text, flags=re.MULTILINE) == ORDER
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.MULTILINE)
    assert rows == [name for _, _, members in grouped_settings(Settings.model_fields) for name in members]


def test_the_quickstart_says_when_the_server_is_ready_and_which_ports_it_binds():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    serve = (ROOT / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "--http-port 8000" in serve and Settings.model_fields["metrics_port"].default == 9481
    for said in ("SERVING models: default", "127.0.0.1:50051", ":8000", ":9481", "--http-port 0 --metrics-port 0"):
        assert said in quickstart, said
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in quickstart


def test_the_server_extra_needs_no_triton_so_make_serve_installs_on_macos():
    """No triton wheel exists for macOS: the dev extra names triton (the kernel tests' CPU
    interpreter), the server extra must not, and the server imports it only on a CUDA device."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(pin.startswith("triton") for pin in extras["server"])
    assert any(pin.startswith("triton") for pin in extras["dev"])
    service = ROOT / "service" / "logprob_service"
    top_level = [
        path.relative_to(service).as_posix()
        for path in service.rglob("*.py")
        if re.search(r"^(import triton|from triton)", path.read_text(), flags=re.MULTILINE)
    ]
    # Only the kernel modules, which ops/dispatch.py, ops/digest.py, ops/fp8.py and ops/mxfp4.py
    # import lazily on CUDA.
    assert sorted(top_level) == [
        "ops/digest_kernel.py",
        "ops/fp8_kernel.py",
        "ops/lm_head/candidates.py",
        "ops/lm_head/fused_logprobs.py",
        "ops/lm_head/keys.py",
        "ops/lm_head/plans.py",
        "ops/lm_head/repair.py",
        "ops/lm_head/selection.py",
        "ops/lm_head/survivors.py",
        "ops/lm_head/threshold.py",
        "ops/lm_head/tiles.py",
        "ops/mxfp4_kernel.py",
    ]
