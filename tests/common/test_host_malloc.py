"""host_malloc.keep_freed_blocks: a weight push's large message copies reuse warm pages; the
setting applied once, at the start of the ``serve`` command."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from logprob_service import host_malloc, logs, startup
from logprob_service.cli import main

# 16 blocks of 4 MiB written and freed together, round after round: a push's messages in flight.
# With glibc's defaults the freed heap top (64 MiB) is handed back each round and every page of the
# next round faults in again (16,384 faults a round on this machine); kept, none do.
CHURN = textwrap.dedent(
    """
    import os, resource, sys
    from logprob_service import host_malloc
    if sys.argv[1] == "keep" and not host_malloc.keep_freed_blocks():
        sys.exit("keep_freed_blocks refused")
    source = os.urandom(4 << 20)
    def churn():
        live = [b"".join((source, b"x")) for _ in range(16)]
        del live
    churn(), churn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        churn()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8)
    """
)
PAGES_A_ROUND = 16 * (4 << 20) // 4096


def faults_a_round(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_blocks_are_reused_without_page_faults() -> None:
    # At most 1/16 of the round's pages fault in anew (none did here); glibc's defaults fault all.
    assert faults_a_round("keep") < PAGES_A_ROUND / 16


@pytest.mark.parametrize("keep", [True, False])
def test_serve_sets_the_allocator_at_start_up_before_the_server(keep, monkeypatch):
    done = []
    monkeypatch.setattr(host_malloc, "keep_freed_blocks", lambda: done.append("keep freed blocks") or True)
    monkeypatch.setattr(logs, "configure_logging", lambda *args: None)

    async def serve(settings):
        done.append("serve")

    monkeypatch.setattr(startup, "serve", serve)
    assert main(["serve", "--keep-freed-host-memory" if keep else "--no-keep-freed-host-memory"]) == 0
    assert done == (["keep freed blocks", "serve"] if keep else ["serve"])
