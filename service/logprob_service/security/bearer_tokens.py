"""Bearer tokens: where they come from, and looking one up in constant time.

A token document (YAML or JSON) lists the clients; it comes from the file ``auth_tokens_file``
and/or the environment variable ``LOGPROB_AUTH_TOKENS`` (both are read, never a flag):

    tokens:
      - name: trainer-a              # who the client is: in logs, error messages and the fair share
        scopes: [score]
        sha256: <64 hex digits>      # sha256 of the token: the file then holds no secret
      - name: ops
        scopes: [score, admin]
        token: <the token>           # or the token itself (at least 16 characters)

Every token is kept only as its sha256 digest. A presented token is hashed and compared with
every entry by ``hmac.compare_digest``, and the loop never stops early, so the time taken says
nothing about which entry, or how much of one, matched. A fast hash is enough because tokens
are long random strings (``python -c "import secrets; print(secrets.token_urlsafe(32))"``), not
passwords to stretch. Errors name the source, the entry and the field, never a token's value.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from logprob_service.errors import PermissionDenied, Unauthenticated
from logprob_service.settings.model import Settings

Scope = Literal["score", "admin"]
MIN_TOKEN_CHARS = 16


class TokenConfigError(ValueError):
    """The token document is unreadable or invalid (the message never holds a token)."""


class _Entry(BaseModel):
    # hide_input_in_errors: a validation error must not echo a token back into a log.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    name: str = Field(min_length=1)
    scopes: frozenset[Scope] = Field(min_length=1)
    token: SecretStr | None = None
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")

    @model_validator(mode="after")
    def _one_secret(self) -> _Entry:
        if (self.token is None) == (self.sha256 is None):
            raise ValueError("give exactly one of token and sha256")
        if self.token is not None and len(self.token.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(f"token is shorter than {MIN_TOKEN_CHARS} characters; use a long random string")
        return self

    @property
    def digest(self) -> bytes:
        if self.token is not None:
            return hashlib.sha256(self.token.get_secret_value().encode()).digest()
        return bytes.fromhex(self.sha256)  # type: ignore[arg-type]  # one of the two is set


class _Document(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    tokens: list[_Entry]


@dataclass(frozen=True)
class Principal:
    """Who a valid token belongs to, and what it may do."""

    name: str
    scopes: frozenset[str]


class TokenTable:
    def __init__(self, entries: list[tuple[Principal, bytes]]) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> Principal | None:
        """The principal ``token`` belongs to, or None; constant time in the token's content."""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for principal, expected in self._entries:
            if hmac.compare_digest(digest, expected):
                found = principal
        return found


def check_bearer(tokens: TokenTable, header: str | None, method: str, scope: Scope, carrier: str) -> Principal:
    """The principal whose token the ``authorization`` value ``header`` carries (None: absent), if
    it has ``scope``, which ``method`` needs; ``carrier`` names where the value comes from in the
    caller's terms (gRPC "metadata", HTTP "header"). The one check of both edges."""
    if header is None:
        raise Unauthenticated(f"no credentials: this server needs the {carrier} 'authorization: Bearer <token>'")
    scheme, _, token = str(header).partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated(f"authorization {carrier} is not of the form 'Bearer <token>'")
    principal = tokens.lookup(token.strip())
    if principal is None:
        raise Unauthenticated("the bearer token is not valid for this server")
    if scope not in principal.scopes:
        scopes = ", ".join(sorted(principal.scopes))
        raise PermissionDenied(f"token {principal.name!r} has scopes [{scopes}]; {method} needs scope {scope!r}")
    return principal


def _parse(text: str, source: str) -> list[_Entry]:
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        # Not str(err): PyYAML quotes the offending line, which may hold a token.
        raise TokenConfigError(f"{source}: not a YAML or JSON document{where}") from None
    try:
        return _Document.model_validate(document).tokens
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'document'}: {e['msg']}" for e in err.errors())
        raise TokenConfigError(f"{source}: {problems}") from None


def load_token_table(settings: Settings) -> TokenTable | None:
    """The tokens of ``auth_tokens_file`` and ``LOGPROB_AUTH_TOKENS`` together; None when neither
    is set (authentication off)."""
    documents: list[tuple[str, str]] = []
    if settings.auth_tokens_file is not None:
        documents.append((str(settings.auth_tokens_file), settings.auth_tokens_file.read_text()))
    if settings.auth_tokens is not None:
        documents.append(("LOGPROB_AUTH_TOKENS", settings.auth_tokens.get_secret_value()))
    if not documents:
        return None
    entries = [(source, entry) for source, text in documents for entry in _parse(text, source)]
    if not entries:
        raise TokenConfigError(f"{' and '.join(s for s, _ in documents)}: no tokens listed, so no one could call")
    names: dict[str, str] = {}
    digests: dict[bytes, str] = {}
    for source, entry in entries:
        if entry.name in names:
            raise TokenConfigError(f"{source}: token name {entry.name!r} is also used in {names[entry.name]}")
        if entry.digest in digests:
            raise TokenConfigError(f"{source}: token {entry.name!r} is the same token as {digests[entry.digest]!r}")
        names[entry.name], digests[entry.digest] = source, entry.name
    return TokenTable([(Principal(entry.name, frozenset(entry.scopes)), entry.digest) for _, entry in entries])
