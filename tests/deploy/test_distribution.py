"""The distribution: ready for an index, and install hints that work before it is on one.

The package is on no index yet, so ``pip install 'logprob-service[trl]'`` fails (and anyone could
register the name): no message or page may say it. The hints name what works today: the extra's
own packages (``pip install trl==1.16.0``), or the project from a checkout or its wheel. The sdist
and wheel ``python -m build`` makes pass ``twine check``, so the day the package is published
the metadata is what an index shows.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.test_manifests import context_files, run

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# "pip install 'logprob-service[...]'" in any quoting, and the same through `python -m pip`.
INDEX_INSTALL = re.compile(r"""pip install\s+(?:-\S+\s+)*['"]?logprob-service\[""")


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.splitlines() if (ROOT / name).is_file()]


def test_no_hint_installs_the_package_from_an_index():
    offending = []
    for path in tracked_files():
        if path == Path(__file__).resolve():  # this test names the hint it looks for
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        offending += [
            f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1) if INDEX_INSTALL.search(line)
        ]
    assert not offending, offending


def test_the_integrations_hints_name_the_extras_own_pins():
    extras = PROJECT["optional-dependencies"]
    integrations = ROOT / "client" / "logprob_client" / "integrations"
    (trl_pin,) = extras["trl"]
    for module in ("trl.py", "trl_teacher.py"):
        assert f"pip install {trl_pin}" in (integrations / module).read_text(), module
    tensordict = next(pin for pin in extras["verl"] if pin.startswith("tensordict"))
    for module in ("verl.py", "verl_actor.py", "verl_checkpoint.py"):
        assert f"pip install verl==0.9.1 {tensordict}" in (integrations / module).read_text(), module


def test_the_metadata_is_what_an_index_shows():
    for key in ("description", "readme", "license", "requires-python", "classifiers", "keywords"):
        assert PROJECT.get(key), key
    assert PROJECT["readme"] == "README.md" and not any("License ::" in c for c in PROJECT["classifiers"])
    assert {"build", "twine"} <= {re.split(r"[<>=]", pin)[0] for pin in PROJECT["optional-dependencies"]["dev"]}


@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("build", "twine", "setuptools")),
    reason="needs build, twine and setuptools: the dev extra (make install)",
)
def test_the_sdist_and_wheel_pass_twine_check(tmp_path):
    src = tmp_path / "src"
    for file in context_files():
        (src / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / file, src / file)
    dist = tmp_path / "dist"
    # No isolation: the backend from this environment, nothing downloaded (a few seconds).
    run(sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(dist), str(src))
    built = sorted(p.name for p in dist.iterdir())
    assert [re.sub(r"-\d+(?:\.\d+)*", "-V", name) for name in built] == [
        "logprob_service-V-py3-none-any.whl",
        "logprob_service-V.tar.gz",
    ]
    out = run(sys.executable, "-m", "twine", "check", "--strict", *(str(p) for p in dist.iterdir()))
    assert out.count("PASSED") == 2, out
