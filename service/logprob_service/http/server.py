"""The HTTP edge as a uvicorn server in the engine's event loop: its routes, TLS from the same
settings as gRPC, and a stop that lets answers in flight finish.

Its connections are bounded (``connections``): a cap below the open-file limit, a deadline for
each request's head; ``app`` bounds each body's time and the bytes of all bodies held at once.

uvicorn is run by its parts (``startup``, ``main_loop``, ``shutdown``), not ``Server.serve``,
which would take over SIGTERM/SIGINT from the start-up module that drains both edges.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import ssl
from dataclasses import dataclass

import uvicorn
from starlette.routing import Route

from logprob_service.engine import LogprobEngine
from logprob_service.http import sglang, trl, vllm
from logprob_service.http.app import BodyLimits, Edge
from logprob_service.http.connections import ConnectionLimits, connection_cap, guarded, quiet_accept_errors
from logprob_service.security.bearer_tokens import TokenTable
from logprob_service.security.exposure import exposure_warnings
from logprob_service.security.refusals import RefusalThrottle
from logprob_service.settings.errors import StartupError
from logprob_service.settings.model import Settings

log = logging.getLogger(__name__)

# uvicorn's default: an idle keep-alive connection is closed after this long.
KEEP_ALIVE_S = 5.0


def routes(edge: Edge) -> list[Route]:
    """Every route: the peers' paths (``peer_routes``), each also with its trailing slash flipped,
    answered and accounted as the peer's spelling is (the peers' FastAPI servers answer both;
    Starlette's own way, a 307 with an empty body, would lose a caller that does not follow
    redirects)."""
    spelled = peer_routes(edge)
    flipped = [Route(_flip_slash(r.path), r.endpoint, methods=sorted(r.methods or ())) for r in spelled]
    return spelled + flipped


def peer_routes(edge: Edge) -> list[Route]:
    """The peers' paths, as their clients spell them (docs/http.md): the ``rpc`` labels of the
    HTTP edge's requests."""
    return [
        edge.route("/v1/completions", vllm.completions),
        edge.route("/inference/v1/generate", vllm.generate),
        edge.route("/generate", sglang.generate),
        edge.route("/get_sequence_logprobs/", trl.sequence_logprobs),
        edge.route("/v1/models", vllm.models, methods=("GET",)),
        edge.route("/get_model_info", sglang.model_info, methods=("GET",)),
        edge.route("/health", vllm.health, methods=("GET",), scope=None),
        edge.route("/health_generate", vllm.health, methods=("GET",), scope=None),
    ]


def _flip_slash(path: str) -> str:
    return path[:-1] if path.endswith("/") else path + "/"


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket. Made with ``proto=IPPROTO_TCP``, never 0 (``socket.create_server``'s):
    asyncio turns Nagle's algorithm off only on connections of such a socket, and with it on, an
    answer's body waited for the client's delayed ACK of its headers: 40 ms a request."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(socket.SOMAXCONN)
        return sock
    except OSError as err:
        sock.close()
        raise StartupError(f"cannot serve HTTP on {host}:{port} (--http-port; 0: off): {err.strerror}") from None


@dataclass
class HttpEdge:
    server: uvicorn.Server
    port: int
    task: asyncio.Task
    limits: ConnectionLimits
    bodies: BodyLimits

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop taking connections; requests in flight get ``grace_s`` to be answered."""
        self.server.config.timeout_graceful_shutdown = max(grace_s, 0.1)  # uvicorn's wait times out at 0
        self.server.should_exit = True
        await self.task


async def start_http(
    engine: LogprobEngine,
    settings: Settings,
    host: str,
    port: int,
    *,
    tokens: TokenTable | None,
    refusals: RefusalThrottle | None = None,
) -> HttpEdge:
    """Serve the HTTP edge over ``engine`` on ``host:port`` (0 picks a free port), with TLS when the
    settings name a certificate (mutual when they name client CAs), ``tokens``' authentication and
    ``refusals``' hold of refused calls, shared with the gRPC edge (None: one of the settings' own)."""
    bodies = BodyLimits.of(settings)
    edge = Edge(engine, tokens, bodies, refusals or RefusalThrottle.of(settings))
    tls: dict = {}
    if settings.tls_cert_file is not None:
        tls = {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}
        if settings.tls_client_ca_file is not None:
            tls |= {"ssl_ca_certs": str(settings.tls_client_ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    proxies = list(settings.http_trusted_proxies)
    config = uvicorn.Config(
        edge.app(routes(edge)),
        lifespan="off",
        log_config=None,
        access_log=False,  # every request is logged once, by the edge (app._account)
        server_header=False,
        # X-Forwarded-For names the caller (and so its fair share) only when sent by a proxy named
        # here; uvicorn's default believes any from loopback.
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies or None,
        timeout_keep_alive=KEEP_ALIVE_S,
        **tls,
    )
    config.load()
    limits = ConnectionLimits(connection_cap(settings.http_max_connections), settings.http_header_timeout_s)
    config.http_protocol_class = guarded(config.http_protocol_class, limits)
    quiet_accept_errors(asyncio.get_running_loop())
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    sock = _bind(host, port)
    try:
        await server.startup(sockets=[sock])
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    log.info(
        "HTTP edge: at most %d connections (http_max_connections; open-file limit %d), request heads within "
        "%.0f s, bodies within %.0f s, %d MiB of bodies held at once; proxy headers %s",
        limits.max_connections,
        resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        settings.http_header_timeout_s,
        settings.http_body_timeout_s,
        settings.http_max_buffered_body_bytes // 2**20,
        f"from {', '.join(proxies)}" if proxies else "ignored",
    )
    for warning in exposure_warnings(host, tls=bool(tls), auth=tokens is not None, edge="HTTP"):
        log.warning("%s", warning)

    async def run() -> None:
        await server.main_loop()
        await server.shutdown(sockets=[sock])

    return HttpEdge(server, bound, asyncio.create_task(run(), name="http-edge"), limits, bodies)
