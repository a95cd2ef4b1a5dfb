"""The client package stands alone: no torch, transformers or TRL at import."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_client_imports_without_torch_transformers_or_trl():
    code = (
        "import sys, logprob_client; "
        "from logprob_client import LogprobClient, AsyncLogprobClient; "
        "bad = [m for m in ('torch', 'transformers', 'trl', 'logprob_service') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize(
    "module,missing,hint",
    [
        ("logprob_client.losses", "torch", "needs torch: pip install torch"),
        ("logprob_client.integrations.trl", "trl", "needs TRL (the [trl] extra): pip install trl==1.16.0"),
    ],
)
def test_optional_modules_say_what_to_install(module, missing, hint):
    # sys.modules[name] = None makes `import name` fail, as on an install without it.
    code = f"import sys; sys.modules[{missing!r}] = None; import {module}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and f"ImportError: {module} {hint}" in done.stderr, done.stderr


def python_blocks() -> list[tuple[str, str]]:
    """The ```python blocks of the README and the docs, with where each is."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    return [
        (f"{page.relative_to(ROOT)} block {i}", block)
        for page in pages
        if page.exists()
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
    ]


def test_snippets_that_import_the_client_import_every_name_of_it_they_use():
    """A snippet with imports is meant to run as it stands: the README's TRL snippet used
    ``RemotePolicy`` (in its commented-out option) without importing it."""
    pytest.importorskip("trl")
    import logprob_client
    from logprob_client.integrations import trl

    names = set(logprob_client.__all__) | {n for n in vars(trl) if n[0].isupper() and n.startswith(("Remote", "TRL"))}
    checked = 0
    for where, block in python_blocks():
        imports = re.findall(r"^from logprob_client\S* import (\([^)]*\)|.*)$", block, re.M)
        if not imports:
            continue  # a fragment of a longer program
        checked += 1
        imported = {name for listed in imports for name in re.findall(r"\w+", listed)}
        used = {name for name in names if re.search(rf"\b{name}\b", block)}
        assert used <= imported, f"{where} uses {sorted(used - imported)} without importing them"
    assert checked, "no snippet imports the client"
