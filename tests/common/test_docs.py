"""The docs hold what the code does: the configuration reference is generated from the settings
model, and the metrics table, the loss helpers, the TRL integration's exports, the README's
figures, the examples' imports and the links between pages are checked against their sources."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest
from logprob_service.observability import metrics  # noqa: F401  (registers the series)
from logprob_service.settings.model import Settings
from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "benchmarks" / "RESULTS.md").read_text()
# The pages a user reads, each checked for links and self-contained examples.
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole line), up to the next heading of the same level."""
    level = heading.split(" ", 1)[0]
    body = text.split("\n" + heading + "\n", 1)[1]
    return re.split(rf"\n{level} ", body, maxsplit=1)[0]


def generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_what_the_settings_model_generates():
    text = generator().render()
    # One row per setting, each with its flag (or none, for a secret) and its variable.
    for name in Settings.model_fields:
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        assert f"`LOGPROB_{name.upper()}`" in row, row
    assert (DOCS / "configuration.md").read_text() == text, (
        "docs/configuration.md differs from the settings model: run `make docs`"
    )


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    rows = re.findall(r"^\| `(logprob_[a-z_]+)` \| (\w+) \|([^|]*)\|", (DOCS / "metrics.md").read_text(), flags=re.M)
    return {name: (kind, frozenset(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def exported_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """Every ``logprob_`` family of the registry /metrics serves, named as a scrape shows it, with
    its type and labels (the GPU families too, declared even without a GPU)."""
    suffix = {"counter": "_total", "info": "_info"}
    exported = {}
    for collector in set(REGISTRY._names_to_collectors.values()):
        describe = getattr(collector, "describe", None)  # prometheus-client's process collectors have none
        for family in describe() if describe else ():
            if not family.name.startswith("logprob_"):
                continue
            labels = getattr(collector, "_labelnames", None) or getattr(family, "_labelnames", ())
            if family.type == "info":  # its labels are the info's keys, on its one sample
                (sample,) = next(f for f in REGISTRY.collect() if f.name == family.name).samples
                labels = sample.labels
            exported[family.name + suffix.get(family.type, "")] = (family.type, frozenset(labels))
    return exported


def test_the_metrics_table_lists_every_family_with_its_type_and_labels():
    exported = exported_metrics()
    assert len(exported) >= 20, exported
    assert documented_metrics() == exported


def test_every_loss_helper_is_in_the_losses_table():
    from logprob_client import losses

    public = {
        name
        for name, obj in vars(losses).items()
        if inspect.isfunction(obj) and obj.__module__ == losses.__name__ and not name.startswith("_")
    }
    table = section((DOCS / "client.md").read_text(), "## Loss and KL helpers")
    documented = set(re.findall(r"`([a-z_0-9]+)[`(]", table)) & public
    assert public and public == documented, public - documented


def test_the_trl_guide_names_what_the_integration_exports():
    pytest.importorskip("trl", reason="trl is optional: pip install trl==1.16.0")
    from logprob_client.integrations import trl

    guide = (DOCS / "trl.md").read_text()
    for name in ("RemoteReferenceGRPOTrainer", "RemoteReference", "RemotePolicy", "TRLVersionError"):
        assert name in guide and hasattr(trl, name), name
    assert trl.CHECKED_TRL_VERSION in guide
    assert '"logprob-service[trl]"' in guide and "_get_per_token_logps_and_entropies" in guide


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_examples_import_every_class_they_call(page):
    # A block that imports is meant to run as it is: every class it calls, in code or in a
    # commented-out line to uncomment, is imported there.
    for block in python_blocks(page):
        imported = set(re.findall(r"^(?:from \S+ )?import (.+)$", block, flags=re.M))
        names = {n.strip() for line in imported for n in line.split(",")}
        if not names:
            continue
        called = set(re.findall(r"(?<!was: )\b([A-Z][A-Za-z]+)\(", block))  # "# was: X(" names the old call
        assert called <= names, (called - names, block)


def test_the_readme_results_are_figures_of_results_md():
    results = section(README, "## Results")
    measured = set(NUMBER.findall(RESULTS))
    figures = NUMBER.findall(results)
    assert len(figures) > 50
    assert set(figures) <= measured, set(figures) - measured
    # Speed-ups quoted anywhere else in the README are the table's, so the page agrees with itself.
    elsewhere = README.replace(results, "")
    assert set(re.findall(r"(\d+(?:\.\d+)?)x\b", elsewhere)) <= set(re.findall(r"(\d+(?:\.\d+)?)x\b", results))


def test_every_results_section_names_its_torch_version():
    sections: list[list[str]] = []
    fenced = False
    for line in RESULTS.splitlines():
        fenced ^= line.startswith("```")  # a "## " inside a code block (a run's printed header) is no section
        if line.startswith("## ") and not fenced:
            sections.append([])
        if sections:
            sections[-1].append(line)
    assert len(sections) >= 10
    for lines in sections:
        assert re.search(r"torch 2\.\d+\.\d+|torch version not recorded", "\n".join(lines), flags=re.I), lines[0]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_reach_their_files_and_headings(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), (page.name, target)
        if anchor and linked.suffix == ".md":
            code_free = re.sub(r"```.*?```", "", linked.read_text(), flags=re.S)
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", code_free, flags=re.M)}
            assert anchor in headings, (page.name, target)


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= 300
    quickstart = section(README, "## Quickstart")
    assert re.search(r"^make serve +#", quickstart, flags=re.M) and re.search(r"^make test +#", quickstart, flags=re.M)


@pytest.mark.parametrize(("heading", "guide"), [("## verl", "verl.md"), ("## OpenRLHF", "openrlhf.md")])
def test_the_readme_s_framework_lines_are_its_guide_s_which_the_framework_tests_run(heading, guide):
    """The README's override lines and commands for verl and OpenRLHF are lines of their guide's
    code blocks, which tests/frameworks runs as written (read from the page or spelled there)."""

    def block_lines(text: str) -> set[str]:
        blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, re.S)
        return {line.strip().rstrip("\\").strip() for block in blocks for line in block.splitlines() if line.strip()}

    readme = block_lines(section(README, heading))
    assert readme, f"no code lines in the README's {heading} section"
    missing = readme - block_lines((DOCS / guide).read_text())
    assert not missing, f"README lines not in docs/{guide}: {sorted(missing)}"
