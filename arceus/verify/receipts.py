"""Receipts: a stage signs (Ed25519) the digest of every activation it accepts from its previous stage
(role "received") and, on audited train steps, of every activation it sends on (role "sent"), so a
receiver's account can be held against its producer's.

The payload is fixed text, so the agent, the driver and the control plane build the same bytes from the
same fields; the key is the agent's per-registration key, whose public half the control plane stores. A
receipt's digest is `arceus.verify.tensor_digest`'s (torch); the receipts themselves need none.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_HEX_LENGTH = 64  # raw 32-byte Ed25519 key
RECEIVED, SENT = "received", "sent"
# Replicated stages, audited steps: a replica's partial gradient before the exchange (signed by that replica;
# stage_index its own stage, micro_batch -1, both replicas its own), and a gradient a replica of stage
# `stage_index + 1` (`producer_replica`) sent upstream to replica `receiver_replica` of stage `stage_index`.
PARTIAL, GRADIENT = "partial", "gradient"
# ... and chunk `micro_batch` of the summed gradient a replica (`receiver_replica`) applies, whose chunk's owner (which
# summed it) is `producer_replica`.
REDUCED = "reduced"


class ReceiptError(ValueError):
    """A receipt or key that cannot be checked, or whose signature does not verify."""


@dataclass(frozen=True)
class ReceiptFields:
    job_id: str
    stage_index: int  # the receiving stage
    generation: int
    step: int
    micro_batch: int
    sha256: bytes
    role: str = RECEIVED  # signed too: a producer's "sent" receipt cannot pass for a receiver's
    # Replicated stages (arceus/swarm): which replica of the producing stage (stage_index - 1) made the activation
    # and which replica of the receiving stage took it; 0 and 0 where the stages are not replicated. With the
    # signing node's key they name the producing replica: stage, replica id and node.
    producer_replica: int = 0
    receiver_replica: int = 0

    def payload(self) -> bytes:
        return (
            f"arceus-receipt-v3\n{self.role}\n{self.job_id}\n{self.stage_index}\n{self.generation}\n{self.step}\n"
            f"{self.micro_batch}\n{self.sha256.hex()}\n{self.producer_replica}\n{self.receiver_replica}"
        ).encode()


@dataclass(frozen=True)
class ShardFields:
    """What a replica signs for each gradient shard it pushes to a sibling on an audited step: elements
    [start, start + length) of its partial gradient, whose float32 bytes hash to `sha256`."""

    job_id: str
    stage_index: int
    generation: int
    step: int
    epoch: int
    source_replica: int
    start: int
    length: int
    sha256: bytes

    def payload(self) -> bytes:
        return (
            f"arceus-shard-v1\n{self.job_id}\n{self.stage_index}\n{self.generation}\n{self.step}\n{self.epoch}\n"
            f"{self.source_replica}\n{self.start}\n{self.length}\n{self.sha256.hex()}"
        ).encode()


class ReceiptSigner:
    """A fresh key pair; the agent makes one per registration (a restarted agent gets a new one)."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public_key_hex = self._key.public_key().public_bytes_raw().hex()

    def sign(self, fields: ReceiptFields | ShardFields) -> bytes:
        return self._key.sign(fields.payload())


def load_public_key(public_key_hex: str) -> Ed25519PublicKey:
    """ReceiptError unless `public_key_hex` is 64 hex digits."""
    try:
        raw = bytes.fromhex(public_key_hex)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ReceiptError(f"a public key is {PUBLIC_KEY_HEX_LENGTH} hex digits (raw Ed25519), got {public_key_hex!r}")
    return Ed25519PublicKey.from_public_bytes(raw)


def verify_shard(public_key_hex: str, fields: ShardFields, signature: bytes) -> None:
    """ReceiptError saying why unless `signature` is the key's signature of the shard `fields` names."""
    _verify(
        public_key_hex,
        fields,
        signature,
        "shard",
        f"the shard at element {fields.start} of step {fields.step} from replica {fields.source_replica} "
        "does not verify against its node's public key",
    )


def verify_receipt(public_key_hex: str, fields: ReceiptFields, signature: bytes) -> None:
    """ReceiptError saying why unless `signature` is the key's signature of `fields`."""
    _verify(
        public_key_hex,
        fields,
        signature,
        "receipt",
        f"receipt for step {fields.step} micro-batch {fields.micro_batch} of stage {fields.stage_index} "
        "does not verify against the node's public key",
    )


def _verify(public_key_hex: str, fields: ReceiptFields | ShardFields, signature: bytes, what: str, forged: str) -> None:
    """ReceiptError naming `what` if its digest is not 32 bytes, `forged` if `signature` does not verify."""
    if len(fields.sha256) != 32:
        raise ReceiptError(f"{what} digest is {len(fields.sha256)} bytes, expected 32")
    try:
        load_public_key(public_key_hex).verify(signature, fields.payload())
    except InvalidSignature:
        raise ReceiptError(forged) from None
