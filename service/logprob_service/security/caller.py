"""Who is calling: the client identity the fair share, the logs and error messages use.

Set once per call, before the handler runs, by the gRPC edge (``api.auth.AuthInterceptor``)
and the HTTP edge (``http.app``), and read anywhere below it in the same call (tasks the handler
starts inherit it):

- with authentication, the name of the caller's token: a trainer is one client however many
  connections or processes it uses, and cannot pose as another;
- without, the IP address of the caller's connection (not its port), so a trainer's several
  channels or ranks on one host share one share. Without authentication nothing a client says
  about itself can be trusted, so no self-declared id is taken: give each trainer a token to
  tell apart trainers that share a host.
"""

from __future__ import annotations

from contextvars import ContextVar

_CLIENT: ContextVar[str] = ContextVar("logprob_client_identity", default="")


def current_client() -> str:
    """The current call's client identity ("" outside a call, e.g. the server's own warm-up)."""
    return _CLIENT.get()


def set_client(identity: str) -> None:
    _CLIENT.set(identity)


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string: "ipv4:10.0.0.7:53122" -> "10.0.0.7",
    "ipv6:[::1]:53122" -> "::1"; anything else (a unix socket) as it is."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return peer
