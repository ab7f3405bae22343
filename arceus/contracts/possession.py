"""Proof that a registering agent holds the private key of the TLS certificate it registers: it signs the control
plane's challenge (`POST /api/agent/challenge`, bound to its node and short-lived) with that key, and the control
plane checks the signature against the certificate before it records it. Without the proof a node could register
another node's certificate and address, and the dial-back would find the other node's agent answering for it.

The signed bytes name their purpose, the challenge and the certificate's key, so a signature made for anything
else (a TLS handshake, another registration) is no proof here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

_PURPOSE = b"arceus registration proof v1\n"
MAX_PROOF_CHARS = 1024  # base64 of an RSA-4096 signature is 684 characters


def key_sha256(certificate_pem: str) -> str:
    """SHA-256 hex of the certificate's public key (DER SubjectPublicKeyInfo): one key, one node."""
    return hashlib.sha256(_public_key_der(_certificate(certificate_pem))).hexdigest()


def possession_sign(key_pem: bytes, challenge: str, certificate_pem: str) -> str:
    """The proof (base64) that the holder of `key_pem` registers `certificate_pem` for `challenge`."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    message = _message(challenge, certificate_pem)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(message, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(message, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ed25519.Ed25519PrivateKey):
        signature = key.sign(message)
    else:
        raise ValueError(f"cannot sign with a {type(key).__name__}: use an EC (P-256), RSA or Ed25519 key")
    return base64.b64encode(signature).decode()


def possession_check(certificate_pem: str, challenge: str, proof: str) -> None:
    """Nothing if `proof` is the certificate key's signature of `challenge`; ValueError saying what is wrong."""
    if not isinstance(proof, str) or not proof or len(proof) > MAX_PROOF_CHARS:
        raise ValueError(f"must be a base64 signature of at most {MAX_PROOF_CHARS} characters")
    try:
        signature = base64.b64decode(proof, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("is not base64") from None
    key = _certificate(certificate_pem).public_key()
    message = _message(challenge, certificate_pem)
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, message)
        else:
            raise ValueError(f"the certificate's {type(key).__name__} cannot sign a proof: use EC, RSA or Ed25519")
    except InvalidSignature:
        raise ValueError(
            "is not a signature of this challenge by the certificate's key: only the holder of the key may "
            "register the certificate"
        ) from None


def _message(challenge: str, certificate_pem: str) -> bytes:
    return _PURPOSE + challenge.encode() + b"\n" + key_sha256(certificate_pem).encode()


def _certificate(pem: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem.encode())
    except ValueError as exc:
        raise ValueError(f"not a PEM certificate: {exc}") from None


def _public_key_der(certificate: x509.Certificate) -> bytes:
    return certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
