"""Authentication and authorization of LogprobService calls: one interceptor, one scope table.

With tokens configured (``security.bearer_tokens``, whose ``check_bearer`` the HTTP edge runs
too), every LogprobService call must carry the metadata
``authorization: Bearer <token>``. No token, or one the server does not know: UNAUTHENTICATED.
A known token without the scope the method needs: PERMISSION_DENIED. Both are decided from the
metadata alone, before the handler runs (a stream's messages are not even read). Health and
reflection are other services and stay open: probes and ``grpcurl list`` need no token.

Every LogprobService call, authenticated or not, then runs with its client identity set
(``security.caller``): the token's name, or without authentication the peer's IP address.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from logprob_service.api import handlers
from logprob_service.errors import LogprobError
from logprob_service.security.bearer_tokens import Principal, Scope, TokenTable, check_bearer
from logprob_service.security.caller import peer_host, set_client

# The one table of which scope each LogprobService method needs. A method not listed needs
# admin: weight updates, and any state-changing RPC added later, are closed to score tokens by
# default rather than open until someone remembers to list them.
METHOD_SCOPES: dict[str, Scope] = {"ScoreTokens": "score", "ScoreTokensStream": "score", "ListModels": "score"}
DEFAULT_SCOPE: Scope = "admin"


def required_scope(rpc: str) -> Scope:
    return METHOD_SCOPES.get(rpc, DEFAULT_SCOPE)


def authorize(tokens: TokenTable, rpc: str, metadata: Sequence[tuple[str, Any]]) -> Principal:
    """The principal whose bearer token ``metadata`` carries, if it may call ``rpc``."""
    header = next((value for key, value in metadata if key == "authorization"), None)
    return check_bearer(tokens, header, rpc, required_scope(rpc), "metadata")


class AuthInterceptor(handlers.ServiceInterceptor):
    """Checks credentials (when ``tokens`` is set) and names the client, before any other
    interceptor but the hold of refused calls (``interceptors.HeldRefusals``), which reads the name."""

    def __init__(self, tokens: TokenTable | None) -> None:
        self._tokens = tokens

    def wrap(self, handler: grpc.RpcMethodHandler, rpc: str, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        principal = None
        if self._tokens is not None:
            try:
                principal = authorize(self._tokens, rpc, details.invocation_metadata or ())
            except LogprobError as err:
                return handlers.rebuild(handler, _refusal(rpc, err))
        inner = handlers.behaviour_of(handler)

        async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
            set_client(principal.name if principal is not None else peer_host(context.peer()))
            return await handlers.run(inner, request, context)

        return handlers.rebuild(handler, behaviour)


def _refusal(rpc: str, error: LogprobError) -> handlers.Behaviour:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        set_client(peer_host(context.peer()))  # the only identity an unauthenticated caller has, for the log
        await handlers.reject(context, rpc, error)

    return refuse
