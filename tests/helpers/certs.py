"""Throwaway certificates for the TLS tests: a CA, server and client certificates it signs, and a
second, untrusted CA with a client certificate of its own. Fresh keys every session."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("localhost", "127.0.0.1")
OTHER_NAME = "logprob.test"  # a server name the loopback address does not carry


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA the server and the clients trust
    server: Pair  # for localhost and 127.0.0.1
    named_server: Pair  # only for OTHER_NAME: reachable on loopback with a server name override
    client: Pair  # signed by the CA: passes mutual TLS
    rogue_ca: Path  # another CA
    rogue_client: Pair  # signed by the other CA: refused by mutual TLS


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _issue(
    common_name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    usage: x509.ObjectIdentifier | None = None,
    names: tuple[str, ...] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signing_key = (issuer[0].subject, issuer[1]) if issuer else (_name(common_name), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> Pair:
    cert_path = directory / f"{stem}.crt"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = directory / f"{stem}.key"
    if key is not None:
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return Pair(cert_path, key_path)


def make_pki(directory: Path) -> Pki:
    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    ca_key, rogue_key = key(), key()
    ca = _issue("logprob test CA", ca_key, None)
    rogue = _issue("logprob rogue CA", rogue_key, None)
    pairs = {}
    for stem, issuer, usage, names in (
        ("server", (ca, ca_key), ExtendedKeyUsageOID.SERVER_AUTH, LOOPBACK_NAMES),
        ("named_server", (ca, ca_key), ExtendedKeyUsageOID.SERVER_AUTH, (OTHER_NAME,)),
        ("client", (ca, ca_key), ExtendedKeyUsageOID.CLIENT_AUTH, ()),
        ("rogue_client", (rogue, rogue_key), ExtendedKeyUsageOID.CLIENT_AUTH, ()),
    ):
        private = key()
        pairs[stem] = _write(directory, stem, _issue(stem, private, issuer, usage=usage, names=names), private)
    return Pki(
        ca=_write(directory, "ca", ca).cert,
        rogue_ca=_write(directory, "rogue_ca", rogue).cert,
        **pairs,
    )


def make_self_signed(directory: Path, names: tuple[str, ...] = (OTHER_NAME,)) -> Pair:
    """A self-signed server certificate for ``names`` (by default not loopback's), as
    ``openssl req -x509`` makes one: the certificate is its own root."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue("logprob self-signed", key, None, usage=ExtendedKeyUsageOID.SERVER_AUTH, names=names)
    return _write(directory, "self_signed", cert, key)
