"""A loud warning for each protection a port bound off loopback lacks (both edges log them at
start-up): without TLS, tokens, token ids, scores (and, over gRPC, weights) cross the network
readable by anyone on the path; without tokens, anyone who can reach the port can score (and,
over gRPC, replace model weights)."""

from __future__ import annotations

import ipaddress

# What each edge carries and lets a caller do, for its warnings.
_CARRIES = {"gRPC": "tokens, token ids, scores and weight updates", "HTTP": "tokens, token ids and scores"}
_ALLOWS = {"gRPC": "score and replace model weights", "HTTP": "score with the served models"}


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach ("localhost", 127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warnings(host: str, *, tls: bool, auth: bool, edge: str = "gRPC") -> list[str]:
    """What ``edge`` ("gRPC", "HTTP") bound to ``host`` lacks, one line each; none on loopback."""
    if is_loopback(host):
        return []
    warnings = []
    if not tls:
        warnings.append(
            f"{edge} on {host} is PLAINTEXT and reachable from other machines: {_CARRIES[edge]} cross the "
            "network unencrypted. Set tls_cert_file and tls_key_file (SECURITY.md)."
        )
    if not auth:
        warnings.append(
            f"{edge} on {host} has NO AUTHENTICATION: anyone who can reach the port can {_ALLOWS[edge]}. "
            "Set auth_tokens_file or LOGPROB_AUTH_TOKENS (SECURITY.md)."
        )
    return warnings
