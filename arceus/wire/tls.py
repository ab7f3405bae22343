"""TLS identities of agents and relays: each agent process makes a key and a self-signed certificate, registers the
certificate with the control plane, and its callers (the driver, the sampler, neighbour stages, tensor-parallel
peers) pin exactly that certificate: no certificate authority, and a certificate nobody registered is trusted by
nobody. A relay's identity is the operator's (files made once by `python -m arceus.relay --new-identity`); the
control plane is configured with its certificate and hands it to agents, which pin it like an agent's. The key
and certificate are made with `cryptography`, and checked by `arceus.contracts.certificates`; grpcio does the
TLS (arceus.wire.channels and arceus.relay.channel for callers, the agent's and the relay's servers).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from arceus.contracts.certificates import AGENT_TLS_NAME

VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class TlsIdentity:
    key_pem: bytes
    certificate_pem: bytes

    @property
    def certificate(self) -> str:
        return self.certificate_pem.decode()


def new_identity(tls_name: str = AGENT_TLS_NAME) -> TlsIdentity:
    """A fresh P-256 key and a self-signed certificate for `tls_name`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, tls_name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # callers' clocks may lag a little
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(tls_name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return TlsIdentity(key_pem=key_pem, certificate_pem=certificate.public_bytes(serialization.Encoding.PEM))


def load_identity(key_pem: bytes, certificate_pem: bytes) -> TlsIdentity:
    """An identity from files an operator keeps; ValueError naming what is wrong."""
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        certificate = x509.load_pem_x509_certificate(certificate_pem)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a PEM key and certificate: {exc}") from None
    if key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        raise ValueError("the certificate is not the key's")
    return TlsIdentity(key_pem=key_pem, certificate_pem=certificate_pem)
