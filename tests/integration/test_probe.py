"""``logprob-service probe``, the image's health check, against a running server in each phase."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.helpers.calls import OK, Gate, call, request
from tests.helpers.certs import make_pki, make_self_signed
from tests.helpers.processes import ROOT
from tests.helpers.server import start, stop, test_settings


async def probe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run the probe command as the image does; (exit code, what it printed)."""
    path = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "logprob_service.cli",
        "probe",
        *args,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode().strip()


async def test_probe_follows_the_server_from_warm_up_to_drain(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint), warm=False)
    gate = None
    try:
        # Models loaded, not yet warmed up.
        assert await probe("--address", running.target) == (1, "NOT_SERVING")
        await running.service.warm_up()
        assert await probe("--address", running.target) == (0, "SERVING")
        assert await probe("--address", running.target, "--service", "logprob.v1.LogprobService") == (0, "SERVING")
        assert await probe("--address", running.target, "--service", "nope") == (1, "SERVICE_UNKNOWN: 'nope'")
        # The image's way: no flags; host and port from the same LOGPROB_* settings `serve` reads.
        env = {"LOGPROB_HOST": "0.0.0.0", "LOGPROB_PORT": str(running.port)}
        assert await probe(env=env) == (0, "SERVING")

        # Drain with a request in flight: the first step turns health NOT_SERVING...
        gate = Gate(running)
        in_flight = asyncio.create_task(call(running.target, request(OK, request_id="in-flight")))
        await gate.wait_entered()
        await running.service.engine.draining()
        assert await probe("--address", running.target) == (1, "NOT_SERVING")
        # ...the next closes the port while the in-flight request finishes: still a failing probe.
        drain = asyncio.create_task(running.server.stop(20))
        answers = [await probe("--address", running.target)]
        while answers[-1] == (1, "NOT_SERVING") and not drain.done():  # the port closes as the stop begins
            answers.append(await probe("--address", running.target))
        code, out = answers[-1]
        assert code == 1 and out.startswith(f"no answer from {running.target}: UNAVAILABLE"), answers
        gate.release.set()
        assert (await in_flight).request_id == "in-flight"
        await drain
    finally:
        if gate is not None:
            gate.restore()
        await stop(running)


async def test_probe_fails_without_a_server_or_with_bad_settings():
    code, out = await probe("--address", "127.0.0.1:1", "--timeout-s", "2")
    assert code == 1 and out.startswith("no answer from 127.0.0.1:1"), out
    code, out = await probe(env={"LOGPROB_PORT": "fifty"})  # 1, not serve's 2: a health check knows 0 and 1
    assert code == 1 and out.startswith("logprob-service: LOGPROB_PORT=fifty (--port): Input should be"), out


async def test_probe_speaks_tls_with_the_settings_serve_reads(tmp_path):
    """The image's HEALTHCHECK dialled plaintext, so a server with TLS on never passed it. Now
    the same LOGPROB_* environment that turns TLS (and tokens) on for `serve` turns it on for
    `probe`: a self-signed certificate for a cluster name, not for the loopback address dialled."""
    cert = make_self_signed(tmp_path)
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n  - {name: trainer, scopes: [score], token: " + "t" * 32 + "}\n")
    settings = test_settings(
        Path("unused"),
        models={"default": "builtin:tiny-llama"},
        tls_cert_file=cert.cert,
        tls_key_file=cert.key,
        auth_tokens_file=tokens,
    )
    running = await start(settings)
    env = {
        "LOGPROB_HOST": "0.0.0.0",
        "LOGPROB_PORT": str(running.port),
        "LOGPROB_TLS_CERT_FILE": str(cert.cert),
        "LOGPROB_TLS_KEY_FILE": str(cert.key),
        "LOGPROB_AUTH_TOKENS_FILE": str(tokens),
    }
    try:
        assert await probe(env=env) == (0, "SERVING")
        # Plaintext against the TLS port: what the probe did before, and still no answer.
        code, out = await probe("--timeout-s", "2", env={"LOGPROB_PORT": str(running.port)})
        assert code == 1 and out.startswith("no answer from 127.0.0.1:"), out
        # A CA that did not sign the server's certificate: the chain is checked.
        (tmp_path / "other").mkdir()
        code, out = await probe("--tls-ca-file", str(make_pki(tmp_path / "other").ca), env=env)
        assert code == 1 and "TLS" in out and "CERTIFICATE_VERIFY_FAILED" in out, out
    finally:
        await stop(running)


async def test_probe_presents_a_client_certificate_to_mutual_tls(tmp_path):
    pki = make_pki(tmp_path)
    settings = test_settings(
        Path("unused"),
        models={"default": "builtin:tiny-llama"},
        tls_cert_file=pki.server.cert,
        tls_key_file=pki.server.key,
        tls_client_ca_file=pki.ca,
    )
    running = await start(settings)
    env = {
        "LOGPROB_PORT": str(running.port),
        "LOGPROB_TLS_CERT_FILE": str(pki.server.cert),
        "LOGPROB_TLS_KEY_FILE": str(pki.server.key),
        "LOGPROB_TLS_CLIENT_CA_FILE": str(pki.ca),
    }
    client = ("--tls-client-cert-file", str(pki.client.cert), "--tls-client-key-file", str(pki.client.key))
    try:
        assert await probe(*client, env=env) == (0, "SERVING")
        rogue = (
            "--tls-client-cert-file",
            str(pki.rogue_client.cert),
            "--tls-client-key-file",
            str(pki.rogue_client.key),
        )
        code, out = await probe(*rogue, env=env)
        assert code == 1 and out.startswith("no answer from"), out
    finally:
        await stop(running)
