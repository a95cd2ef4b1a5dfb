"""Token documents, constant-time lookup, the scope table, client identities and exposure warnings
(no server: the interceptor's wire behaviour is in tests/integration/test_security.py)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

import pytest
from logprob_proto import logprob_pb2 as pb
from logprob_service.api.auth import METHOD_SCOPES, authorize, required_scope
from logprob_service.errors import PermissionDenied, Unauthenticated
from logprob_service.security import bearer_tokens as tokens_module
from logprob_service.security.bearer_tokens import TokenConfigError, load_token_table
from logprob_service.security.caller import peer_host
from logprob_service.security.exposure import exposure_warnings, is_loopback
from logprob_service.settings.model import Settings


def fresh_token() -> str:
    return secrets.token_urlsafe(32)


def settings(tmp_path, document: str | None = None, env: str | None = None) -> Settings:
    values: dict = {}
    if document is not None:
        path = tmp_path / "tokens.yaml"
        path.write_text(document)
        values["auth_tokens_file"] = path
    if env is not None:
        values["auth_tokens"] = env
    return Settings(**values)


def test_no_document_means_authentication_off(tmp_path):
    assert load_token_table(settings(tmp_path)) is None


def test_plain_and_hashed_tokens_from_a_file_and_the_environment(tmp_path):
    trainer, ops, ci = fresh_token(), fresh_token(), fresh_token()
    document = f"""
tokens:
  - name: trainer-a
    scopes: [score]
    token: {trainer}
  - name: ops
    scopes: [score, admin]
    sha256: {hashlib.sha256(ops.encode()).hexdigest()}
"""
    env = f'{{"tokens": [{{"name": "ci", "scopes": ["admin"], "token": "{ci}"}}]}}'  # JSON is YAML too
    table = load_token_table(settings(tmp_path, document, env))
    assert len(table) == 3
    assert table.lookup(trainer).name == "trainer-a" and table.lookup(trainer).scopes == {"score"}
    assert table.lookup(ops).scopes == {"score", "admin"}
    assert table.lookup(ci).scopes == {"admin"}
    # One character off, a prefix, an extension, the digest itself: none is a token.
    flipped = trainer[:-1] + ("A" if trainer[-1] != "A" else "B")
    for wrong in (flipped, trainer[:-1], trainer + "x", hashlib.sha256(ops.encode()).hexdigest(), ""):
        assert table.lookup(wrong) is None, wrong


def test_lookup_compares_with_every_entry_whatever_matches(tmp_path, monkeypatch):
    values = [fresh_token() for _ in range(5)]
    document = "tokens:\n" + "".join(f"  - {{name: t{i}, scopes: [score], token: {v}}}\n" for i, v in enumerate(values))
    table = load_token_table(settings(tmp_path, document))
    compared, compare = [], hmac.compare_digest

    def counting(a, b):
        compared.append(1)
        return compare(a, b)

    monkeypatch.setattr(tokens_module.hmac, "compare_digest", counting)
    for token in (values[0], values[4], fresh_token()):
        compared.clear()
        table.lookup(token)
        assert len(compared) == 5  # no early exit at a match, so timing does not tell which entry


@pytest.mark.parametrize(
    "entry,fragment",
    [
        ("{name: a, scopes: [score, root], token: SECRET}", "tokens.0.scopes"),
        ("{name: a, scopes: [score]}", "exactly one of token and sha256"),
        ("{name: a, scopes: [score], token: SECRET, sha256: " + "ab" * 32 + "}", "exactly one of token and sha256"),
        ("{name: a, scopes: [score], sha256: SECRET}", "tokens.0.sha256"),
        ("{name: a, scopes: [], token: SECRET}", "tokens.0.scopes"),
        ("{name: '', scopes: [score], token: SECRET}", "tokens.0.name"),
        ("{name: a, scopes: [score], token: SECRET, extra: SECRET}", "tokens.0.extra"),
        ("{name: a, scopes: [score], token: short}", "shorter than 16 characters"),
    ],
)
def test_invalid_entries_name_the_field_never_the_token(tmp_path, entry, fragment):
    secret = fresh_token()
    document = "tokens:\n  - " + entry.replace("SECRET", secret)
    with pytest.raises(TokenConfigError) as info:
        load_token_table(settings(tmp_path, document))
    message = str(info.value)
    assert fragment in message and "tokens.yaml" in message, message
    assert secret not in message and "short" not in message.replace("shorter", ""), message


def test_unparsable_document_does_not_quote_it(tmp_path):
    secret = fresh_token()
    with pytest.raises(
        TokenConfigError, match=r"LOGPROB_AUTH_TOKENS: not a YAML or JSON document \(line \d+, column \d+\)$"
    ) as info:
        load_token_table(settings(tmp_path, env=f"tokens:\n  - token: [{secret}\n  name: x"))
    assert secret not in str(info.value)


@pytest.mark.parametrize(
    "document,fragment",
    [
        ("tokens: []", "no tokens listed"),
        ("tokens:\n  - {name: a, scopes: [score], token: T1}\n  - {name: a, scopes: [admin], token: T2}", "'a'"),
        ("tokens:\n  - {name: a, scopes: [score], token: T1}\n  - {name: b, scopes: [admin], token: T1}", "same token"),
    ],
)
def test_documents_that_cannot_work_are_refused(tmp_path, document, fragment):
    document = document.replace("T1", fresh_token()).replace("T2", fresh_token())
    with pytest.raises(TokenConfigError, match=fragment):
        load_token_table(settings(tmp_path, document))


def test_the_scope_table_covers_the_service_and_defaults_to_admin():
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["LogprobService"].methods}
    assert set(METHOD_SCOPES) <= methods
    score = {m for m in methods if required_scope(m) == "score"}
    assert score == {"ScoreTokens", "ScoreTokensStream", "ListModels"}
    # Weight updates, and any method added later and not listed, need admin.
    assert {required_scope(m) for m in methods - score} == {"admin"}
    assert {"UpdateWeights", "LoadWeights"} <= methods - score
    assert required_scope("SomeFutureMethod") == "admin"


def test_authorize(tmp_path):
    scorer, admin = fresh_token(), fresh_token()
    table = load_token_table(
        settings(
            tmp_path,
            f"tokens:\n  - {{name: trainer, scopes: [score], token: {scorer}}}\n"
            f"  - {{name: ops, scopes: [admin], token: {admin}}}\n",
        )
    )
    assert authorize(table, "ScoreTokens", [("authorization", f"Bearer {scorer}")]).name == "trainer"
    assert authorize(table, "LoadWeights", [("x-other", "1"), ("authorization", f"bearer {admin}")]).name == "ops"
    for metadata, fragment in (
        ([], "no credentials"),
        ([("authorization", f"Basic {scorer}")], "'Bearer <token>'"),
        ([("authorization", "Bearer ")], "'Bearer <token>'"),
        ([("authorization", f"Bearer {fresh_token()}")], "not valid"),
    ):
        with pytest.raises(Unauthenticated, match=fragment) as info:
            authorize(table, "ScoreTokens", metadata)
        assert scorer not in info.value.message
    with pytest.raises(
        PermissionDenied, match=r"token 'trainer' has scopes \[score\]; UpdateWeights needs scope 'admin'"
    ):
        authorize(table, "UpdateWeights", [("authorization", f"Bearer {scorer}")])
    with pytest.raises(PermissionDenied, match=r"token 'ops' has scopes \[admin\]; ScoreTokens needs scope 'score'"):
        authorize(table, "ScoreTokens", [("authorization", f"Bearer {admin}")])


@pytest.mark.parametrize(
    "peer,host",
    [
        ("ipv4:10.0.0.7:53122", "10.0.0.7"),
        ("ipv6:[::1]:53122", "::1"),
        ("ipv6:[2001:db8::5]:443", "2001:db8::5"),
        ("unix:/run/logprob.sock", "unix:/run/logprob.sock"),
    ],
)
def test_peer_host_drops_the_port(peer, host):
    assert peer_host(peer) == host


@pytest.mark.parametrize(
    "host,loopback",
    [
        *[("127.0.0.1", True), ("127.8.9.1", True), ("localhost", True), ("::1", True), ("[::1]", True)],
        *[("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("logprob.internal", False)],
    ],
)
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_exposure_warnings_are_loud_off_loopback_only():
    assert exposure_warnings("127.0.0.1", tls=False, auth=False) == []
    plaintext, open_door = exposure_warnings("0.0.0.0", tls=False, auth=False)
    assert "PLAINTEXT" in plaintext and "tls_cert_file" in plaintext
    assert "NO AUTHENTICATION" in open_door and "auth_tokens_file" in open_door
    assert exposure_warnings("0.0.0.0", tls=True, auth=False) == [open_door]
    assert exposure_warnings("0.0.0.0", tls=True, auth=True) == []
