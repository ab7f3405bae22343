"""The registration proof (arceus/contracts/possession.py): only the key's holder can make it, for one challenge."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from cryptography.x509.oid import NameOID

from arceus.contracts.possession import key_sha256, possession_check, possession_sign
from arceus.wire.tls import new_identity


def test_the_holder_of_the_key_proves_it_for_one_challenge_only() -> None:
    mine, theirs = new_identity(), new_identity()
    proof = possession_sign(mine.key_pem, "challenge-1", mine.certificate)
    possession_check(mine.certificate, "challenge-1", proof)
    with pytest.raises(ValueError, match="only the holder of the key may register the certificate"):
        possession_check(mine.certificate, "challenge-2", proof)  # another challenge
    with pytest.raises(ValueError, match="only the holder of the key"):
        possession_check(theirs.certificate, "challenge-1", proof)  # my proof shown with their certificate
    with pytest.raises(ValueError, match="only the holder of the key"):  # their certificate, signed with my key
        possession_check(theirs.certificate, "challenge-1",
                         possession_sign(mine.key_pem, "challenge-1", theirs.certificate))


@pytest.mark.parametrize(("proof", "message"), [("", "base64 signature"), ("@@@", "is not base64"),
                                                ("A" * 2000, "at most 1024")])
def test_a_malformed_proof_is_named(proof: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        possession_check(new_identity().certificate, "c", proof)


@pytest.mark.parametrize("make_key", [lambda: rsa.generate_private_key(65537, 2048),
                                      ed25519.Ed25519PrivateKey.generate])
def test_rsa_and_ed25519_keys_an_operator_brings_prove_too(make_key) -> None:  # noqa: ANN001
    key = make_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "arceus-agent")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256())
    ).public_bytes(serialization.Encoding.PEM).decode()
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    possession_check(certificate, "c", possession_sign(key_pem, "c", certificate))


def test_a_key_has_one_fingerprint_whatever_certificate_carries_it() -> None:
    identity = new_identity()
    assert key_sha256(identity.certificate) == key_sha256(identity.certificate)
    assert key_sha256(identity.certificate) != key_sha256(new_identity().certificate)
