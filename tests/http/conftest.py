"""A real server with both edges in the test's event loop (CPU, float32): gRPC on a free port and
the HTTP edge beside it, over the one engine."""

from __future__ import annotations

import hashlib
import secrets

import pytest
import pytest_asyncio

from tests.helpers.server import settings, start, stop

VOCAB = 4096  # builtin:tiny-llama's


class Served:
    """The running server, the gRPC target and the HTTP base URL."""

    def __init__(self, running, http_port: int) -> None:
        self.running = running
        self.target = running.target
        self.base = f"http://127.0.0.1:{http_port}"


async def serve_both(*, warm: bool = True, **overrides) -> Served:
    running = await start(settings({"default": "builtin:tiny-llama"}, **overrides), warm=warm)
    try:
        port = await running.service.start_http("127.0.0.1", 0)
    except BaseException:
        await stop(running)
        raise
    return Served(running, port)


@pytest_asyncio.fixture
async def served():
    both = await serve_both(max_sequences_per_request=16, max_tokens_per_request=4000)
    yield both
    await stop(both.running)


@pytest.fixture(scope="session")
def tokens(tmp_path_factory):
    """A tokens file: a score token given as its sha256, and an admin-only token."""
    values = {name: secrets.token_urlsafe(32) for name in ("trainer", "ops")}
    path = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    path.write_text(
        "tokens:\n"
        f"  - {{name: trainer, scopes: [score], sha256: {hashlib.sha256(values['trainer'].encode()).hexdigest()}}}\n"
        f"  - {{name: ops, scopes: [admin], token: {values['ops']}}}\n"
    )
    return path, values


@pytest_asyncio.fixture
async def authed(tokens):
    both = await serve_both(auth_tokens_file=tokens[0])
    yield both, tokens[1]
    await stop(both.running)
