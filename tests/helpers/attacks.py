"""The attacks of issue-style soak tests, all at once, in a process of their own (so that their
Python work does not delay the measured clients' event loop): ``python -m tests.helpers.attacks
SETTINGS_JSON``, run from the checkout's root.

Each attack loops until the process's stdin closes or ``max_s`` passes, whichever comes first,
and only against 127.0.0.1. The process prints ``ready`` once every attack is in place (the
connections open, the hog's share full, the stream stalled, the flood answered both ways), then,
at the end, one line of JSON: what each attack got (statuses counted)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import httpx
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

SCORE = "/logprob.v1.LogprobService/ScoreTokens"
VOCAB = 4096  # builtin:tiny-llama's
# A head the server waits for: nothing, one byte, or a head cut off before its end.
HALF_SENT = (b"", b"P", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")


@dataclass
class Attack:
    grpc_target: str
    http_base: str
    tokens: dict[str, str]  # attack -> its bearer token (each attack is a client of its own)
    connections: int
    share_tokens: int  # the hog's max_queued_tokens_per_client
    flood_tokens: int  # a top-k call within the answer limits: its tokens
    max_s: float
    only: tuple[str, ...] = ()  # the attacks to run (their functions' names); all when empty
    seen: dict[str, Counter] = field(default_factory=dict)
    ready: dict[str, asyncio.Event] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def count(self, attack: str, outcome: str) -> None:
        self.seen.setdefault(attack, Counter())[outcome] += 1

    def metadata(self, attack: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[attack]}"),)

    def headers(self, attack: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.tokens[attack]}"}

    def event(self, name: str) -> asyncio.Event:
        return self.ready.setdefault(name, asyncio.Event())


def _status(err: grpc.aio.AioRpcError) -> str:
    return err.code().name


async def half_open(attack: Attack) -> None:
    """``connections`` connections to the HTTP port that send a head never finished; one the server
    closes (its head deadline) is opened again."""
    host, port = attack.http_base.removeprefix("http://").rsplit(":", 1)

    async def hold(i: int, opened: list[int]) -> None:
        first = True
        while not attack.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError as err:  # the server gone (SIGTERM): nothing more to hold
                attack.count("half_open", type(err).__name__)
                return
            writer.write(HALF_SENT[i % len(HALF_SENT)])
            attack.count("half_open", "opened")
            if first:
                first = False
                opened.append(i)
                if len(opened) == attack.connections:
                    attack.event("half_open").set()
            try:
                stopped = asyncio.ensure_future(attack.stop.wait())
                closed = asyncio.ensure_future(reader.read(65536))
                await asyncio.wait({stopped, closed}, return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
                closed.cancel()
                if closed.done() and not closed.cancelled():
                    attack.count("half_open", "closed by the server" if not closed.exception() else "reset")
            finally:
                writer.close()

    opened: list[int] = []
    await asyncio.gather(*(hold(i, opened) for i in range(attack.connections)))


async def big_bodies(attack: Attack) -> None:
    """A 6 MB ``/generate`` body of a million ``[1,2]`` inputs and an 8 MB gRPC message of a million
    one-token sequences, each sent again as soon as it is answered."""
    body = b'{"input_ids":[' + b",".join([b"[1,2]"] * 1_000_000) + b'],"return_logprob":true}'
    message = pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=[1], completion_ids=[2])] * 1_000_000)
    raw = message.SerializeToString()

    async def over_http() -> None:
        async with httpx.AsyncClient(base_url=attack.http_base, timeout=30, headers=attack.headers("big")) as http:
            while not attack.stop.is_set():
                try:
                    answer = await http.post("/generate", content=body, headers={"content-type": "application/json"})
                    attack.count("big_http", str(answer.status_code))
                except httpx.HTTPError as err:
                    attack.count("big_http", type(err).__name__)
                    await asyncio.sleep(0.1)
                attack.event("big_http").set()

    async def over_grpc() -> None:
        async with grpc.aio.insecure_channel(attack.grpc_target, options=[("grpc.max_send_message_length", -1)]) as ch:
            score = ch.unary_unary(SCORE)  # bytes as they are: the message is serialized once
            while not attack.stop.is_set():
                try:
                    await score(raw, metadata=attack.metadata("big"), timeout=30)
                    attack.count("big_grpc", "OK")
                except grpc.aio.AioRpcError as err:
                    attack.count("big_grpc", _status(err))
                    if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        await asyncio.sleep(0.1)
                attack.event("big_grpc").set()

    await asyncio.gather(over_http(), over_grpc())


async def unread_stream(attack: Attack) -> None:
    """A ScoreTokensStream whose client sends top-k 256 requests and reads nothing."""
    rng = _rng(1)
    request = pb.ScoreRequest(
        sequences=[pb.Sequence(prompt_ids=rng.integers(3, VOCAB, 4), completion_ids=rng.integers(3, VOCAB, 256))],
        top_k=256,
    )
    async with grpc.aio.insecure_channel(attack.grpc_target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = pb_grpc.LogprobServiceStub(channel).ScoreTokensStream(metadata=attack.metadata("stream"))

        async def send() -> None:
            while True:
                await call.write(request)
                attack.count("stream", "written")

        sender = asyncio.create_task(send())
        # Stalled: no write has gone through for a second.
        written, since = 0, time.monotonic()
        while not attack.stop.is_set():
            await asyncio.sleep(0.1)
            now = attack.seen.get("stream", Counter())["written"]
            if now != written:
                written, since = now, time.monotonic()
            elif time.monotonic() - since > 1.0:
                attack.event("stream").set()
            if sender.done():
                attack.count("stream", "ended")
                attack.event("stream").set()
                break
        sender.cancel()
        call.cancel()


async def hog(attack: Attack) -> None:
    """A client that keeps its whole fair share queued: requests of 4,096 sequences of 64 tokens
    (256 Ki tokens), sent until one is refused for the share, then one more each time an earlier
    one is answered or, when refused, after the server's retry hint."""
    rng = _rng(2)
    ids = rng.integers(3, VOCAB, (4096, 64))
    request = pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=row[:8], completion_ids=row[8:]) for row in ids])
    in_flight = attack.share_tokens // ids.size + 1

    async with grpc.aio.insecure_channel(attack.grpc_target) as channel:
        stub = pb_grpc.LogprobServiceStub(channel)

        async def keep_one() -> None:
            while not attack.stop.is_set():
                try:
                    await stub.ScoreTokens(request, metadata=attack.metadata("hog"), timeout=600)
                    attack.count("hog", "OK")
                except grpc.aio.AioRpcError as err:
                    attack.count("hog", _status(err))
                    if "max_queued_tokens_per_client" in (err.details() or ""):
                        attack.event("hog").set()
                    hint = dict(err.trailing_metadata() or ()).get("grpc-retry-pushback-ms", "100")
                    await asyncio.sleep(min(int(hint), 1000) / 1000)

        await asyncio.gather(*(keep_one() for _ in range(in_flight)))


async def flood(attack: Attack) -> None:
    """top-k 256, two calls at a time each way: over gRPC on 64 Ki completion tokens (past the answer
    limits: refused), over HTTP ``/generate`` on ``flood_tokens`` tokens (within them: answered)."""
    rng = _rng(3)
    past = pb.ScoreRequest(
        sequences=[pb.Sequence(prompt_ids=rng.integers(3, VOCAB, 8), completion_ids=rng.integers(3, VOCAB, 4096))] * 16,
        top_k=256,
    )
    within = {
        "input_ids": [rng.integers(3, VOCAB, attack.flood_tokens).tolist()],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 256,
    }

    async def over_grpc() -> None:
        async with grpc.aio.insecure_channel(attack.grpc_target) as channel:
            stub = pb_grpc.LogprobServiceStub(channel)
            while not attack.stop.is_set():
                try:
                    await stub.ScoreTokens(past, metadata=attack.metadata("flood"), timeout=30)
                    attack.count("flood_past", "OK")
                except grpc.aio.AioRpcError as err:
                    attack.count("flood_past", _status(err))
                    if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        await asyncio.sleep(0.1)
                attack.event("flood_past").set()

    async def over_http() -> None:
        async with httpx.AsyncClient(base_url=attack.http_base, timeout=30, headers=attack.headers("flood")) as http:
            while not attack.stop.is_set():
                try:
                    answer = await http.post("/generate", json=within)
                    attack.count("flood_within", str(answer.status_code))
                except httpx.HTTPError as err:
                    attack.count("flood_within", type(err).__name__)
                    await asyncio.sleep(0.1)
                attack.event("flood_within").set()

    await asyncio.gather(over_grpc(), over_grpc(), over_http(), over_http())


def _rng(stream: int):
    import numpy as np

    return np.random.default_rng([20260054, stream])


ATTACKS = (half_open, big_bodies, unread_stream, hog, flood)
READY = {
    half_open: ("half_open",),
    big_bodies: ("big_http", "big_grpc"),
    unread_stream: ("stream",),
    hog: ("hog",),
    flood: ("flood_past", "flood_within"),
}


async def main(attack: Attack) -> None:
    loop = asyncio.get_running_loop()
    stdin_closed = loop.run_in_executor(None, sys.stdin.read)
    chosen = [a for a in ATTACKS if not attack.only or a.__name__ in attack.only]
    attacks = [asyncio.create_task(a(attack)) for a in chosen]
    names = [name for a in chosen for name in READY[a]]

    async def announce() -> None:
        await asyncio.gather(*(attack.event(name).wait() for name in names))
        print("ready", flush=True)

    announcer = asyncio.create_task(announce())
    await asyncio.wait({asyncio.ensure_future(stdin_closed)}, timeout=attack.max_s)
    attack.stop.set()
    announcer.cancel()
    done, pending = await asyncio.wait(attacks, timeout=5)
    for task in pending:
        task.cancel()
    failed = [repr(t.exception()) for t in done if not t.cancelled() and t.exception()]
    print(json.dumps({"seen": attack.seen, "failed": failed}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(Attack(**json.loads(sys.argv[1]))))
