"""What gRPC Python itself carries on loopback: the ceiling of a weight push, without this service.

A grpc.aio server process with one client-streaming method that takes each message as bytes
(identity deserializer, as ``api/tensor_pieces`` takes a dense piece) and copies its payload into
a buffer on a worker thread (as the server's receiving threads do). The client (this process)
sends ``--total-mib`` of messages of ``P`` MiB over ``S`` streams at once, spread over ``C``
connections (channels with ``grpc.use_local_subchannel_pool``), each message a fresh ``bytes`` made
with one join, as ``logprob_client.weights.dense_piece`` makes it. GB/s of the min-max of
``--repeats`` runs. No GPU is needed; run it on the host whose figures it explains.

Each configuration runs against a server process with glibc's allocator defaults and one that
keeps freed blocks (``logprob_service.host_malloc``, as the service does), then once more with
this client process keeping them too (what ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``
do for a trainer).

Run: python3 benchmarks/bench_transport.py
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import time

import grpc
import numpy as np
from harness import publish
from logprob_service import host_malloc

METHOD = "/bench.Transport/Push"
HEADER = bytes(16)  # stands for a piece's framing


def serve(port_queue, keep_freed: bool) -> None:
    """The server process: counts and copies what it receives; answers the byte count."""
    if keep_freed:
        assert host_malloc.keep_freed_blocks()

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1)])
        sinks = [np.empty(64 << 20, np.uint8) for _ in range(4)]
        pool = concurrent.futures.ThreadPoolExecutor(2)

        async def push(requests, context) -> bytes:
            received, copies = 0, []
            async for i, message in _enumerate(requests):
                payload = np.frombuffer(message, np.uint8)[len(HEADER) :]
                sink = sinks[i % len(sinks)]
                copies.append(pool.submit(np.copyto, sink[: payload.size], payload))
                if len(copies) > 3:
                    await asyncio.wrap_future(copies.pop(0))
                received += len(message)
            for copy in copies:
                await asyncio.wrap_future(copy)
            return received.to_bytes(8, "little")

        handler = grpc.method_handlers_generic_handler(
            "bench.Transport", {"Push": grpc.stream_unary_rpc_method_handler(push)}
        )
        server.add_generic_rpc_handlers((handler,))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _enumerate(requests):
    i = 0
    async for request in requests:
        yield i, request
        i += 1


def push(port: int, piece_mib: int, total_mib: int, streams: int, connections: int) -> float:
    """GB/s of one push of ``total_mib`` over ``streams`` calls on ``connections`` channels."""
    payload = np.frombuffer(os.urandom(piece_mib << 20), np.uint8)
    messages = max(1, total_mib // piece_mib // streams)
    options = [("grpc.max_send_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(connections)]

    def call(stream: int, count: int) -> int:
        pieces = (b"".join((HEADER, memoryview(payload))) for _ in range(count))
        return int.from_bytes(channels[stream % connections].stream_unary(METHOD)(pieces), "little")

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        list(pool.map(call, range(streams), [2] * streams))  # warm-up: connections up
        start = time.perf_counter()
        received = sum(pool.map(call, range(streams), [messages] * streams))
        seconds = time.perf_counter() - start
    for channel in channels:
        channel.close()
    return received / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    servers = {keep: ctx.Process(target=serve, args=(ports, keep), daemon=True) for keep in (False, True)}
    port = {}
    for keep, server in servers.items():  # one at a time: each port is known to be its own
        server.start()
        port[keep] = ports.get(timeout=60)
    lines = [
        "# gRPC Python on loopback: one client process, one grpc.aio server process",
        f"grpc {grpc.__version__}, {os.cpu_count()} CPUs; {args.total_mib} MiB a push; min-max of {args.repeats} runs",
        "",
        "| client allocator | server allocator | piece (MiB) | streams | connections | GB/s |",
        "|---|---|---:|---:|---:|---|",
    ]
    for client_keeps, server_keeps in ((False, False), (False, True), (True, True)):
        if client_keeps:
            assert host_malloc.keep_freed_blocks()
        for piece_mib in (2, 4):
            for streams in (1, 4, 8):
                rates = [
                    push(port[server_keeps], piece_mib, args.total_mib, streams, streams) for _ in range(args.repeats)
                ]
                lines.append(
                    f"| {ALLOCATOR[client_keeps]} | {ALLOCATOR[server_keeps]} | {piece_mib} | {streams} | {streams} | "
                    f"{min(rates):.2f}-{max(rates):.2f} |"
                )
    for server in servers.values():
        server.kill()
    publish("\n".join(lines), "bench_transport.md")


ALLOCATOR = {False: "glibc defaults", True: "keeps freed blocks"}


if __name__ == "__main__":
    main()
