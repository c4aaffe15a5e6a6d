"""Secure aggregation: the server learns the sum of the clients' vectors and nothing else about any one.

The protocol of Bonawitz et al. 2017 (double masking) on the sparse k-regular neighbour graph of
Bell et al. 2020, over the ring Z_(2^64): setup (X25519 key agreement with each neighbour, Shamir
shares of each client's key and self-mask seed: `neighbours`, `shamir_shares`), masked inputs
(`masked_input`, ChaCha20 masks), the consistency check against a malicious server (`sign_survivors`,
`consistent`: a quorum of more than half of the clients must sign one survivor set), and unmasking
(`revealed_shares`, `mask_correction`). Fixed-point encoding (`encode`, `decode`) puts real vectors on
the ring. docs/secure-aggregation.md has each round and the full trust model.

This module is the protocol's arithmetic; pipelines.engines.federated runs it with clients as
elements of a Beam pipeline. Simulation: each client's secrets come from its own 32-byte secret
(`ClientKeys`), which stands for the device's randomness; the server side never reads it.

Privacy: an honest-but-curious server learns the survivors' sum and nothing else about any one
client; an honest client never lets both its self-mask seed and its key be rebuilt. A malicious
server that shows holders different survivor sets is detected; it can still drop clients, abort a
round, and unmask a client with t of its k neighbours corrupted. The PKI is simulated (the server
hands out keys), so a deployment needs keys certified outside the server.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from schemas.errors import UserError

# The servers a federated round can be run against: honest, or partition (a malicious server that shows
# holders different survivor sets to unmask one client; the consistency check must refuse its round).
SERVERS = ("honest", "partition")

FIELD_PRIME = (1 << 521) - 1  # a Mersenne prime above every 32-byte secret
RING_BITS = 64


def derive(secret: bytes, info: bytes) -> bytes:
    """A 32-byte key of `secret` for one purpose (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"ssp secure aggregation: " + info).derive(secret)


def prg(seed: bytes, size: int) -> np.ndarray:
    """`size` pseudorandom ring elements: ChaCha20's keystream under `seed` (32 bytes), nonce 0."""
    out = np.zeros(size, dtype=np.uint64)
    encryptor = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    encryptor.update_into(bytes(8 * size), out.view(np.uint8))
    return out


@dataclass(frozen=True)
class ClientKeys:
    """A client's secrets, derived from its own 32-byte secret: the X25519 key, the Ed25519 signing
    key and the self-mask seed."""

    secret: bytes

    @cached_property
    def private_key(self) -> X25519PrivateKey:
        return X25519PrivateKey.from_private_bytes(derive(self.secret, b"x25519"))

    @cached_property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @cached_property
    def signing_key(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(derive(self.secret, b"ed25519"))

    @cached_property
    def verify_key(self) -> bytes:
        """The Ed25519 verification key, distributed at setup with the public key."""
        return self.signing_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @cached_property
    def self_mask_seed(self) -> bytes:
        return derive(self.secret, b"self mask")

    @property
    def private_bytes(self) -> bytes:
        return derive(self.secret, b"x25519")

    @cached_property
    def noise_seed(self) -> bytes:
        """The seed of the client's noise share (privacy.skellam)."""
        return derive(self.secret, b"noise")


def pairwise_seed(private_bytes: bytes, peer_public: bytes) -> bytes:
    """The seed two clients agree (either side computes it from its private key and the other's public key)."""
    shared = X25519PrivateKey.from_private_bytes(private_bytes).exchange(X25519PublicKey.from_public_bytes(peer_public))
    return derive(shared, b"pairwise")


def neighbour_count(clients: int) -> int:
    """k of the graph: 2 ceil(log2 n) (Bell et al.: O(log n) neighbours suffice), at most n - 1."""
    return max(0, min(2 * math.ceil(math.log2(max(clients, 2))), clients - 1))


def neighbours(clients: np.ndarray, round_seed: bytes, k: int | None = None) -> dict[int, list[int]]:
    """The public graph: client ids on a cycle in an order shuffled by `round_seed`, each joined to
    the k/2 before and the k/2 after it (the complete graph when k >= n - 1)."""
    ids = np.unique(np.asarray(clients, dtype=np.int64))
    n = ids.size
    k = neighbour_count(n) if k is None else k
    keys = [hashlib.sha256(round_seed + int(i).to_bytes(8, "big", signed=True)).digest() for i in ids]
    ring = [int(ids[q]) for q in sorted(range(n), key=keys.__getitem__)]
    if k >= n - 1:
        return {i: [j for j in ring if j != i] for i in ring}
    half = k // 2
    return {ring[q]: sorted({ring[(q + step) % n] for step in range(-half, half + 1) if step}) for q in range(n)}


def threshold(k: int) -> int:
    """Shares needed to rebuild a secret: a majority of the k neighbours."""
    return k // 2 + 1


def shamir_shares(secret: bytes, holders: list[int], t: int, rng: secrets.SystemRandom | None = None) -> dict[int, int]:
    """Shamir shares of `secret` for the holders (share of holder at x = position + 1); any t rebuild it."""
    rng = rng or secrets.SystemRandom()
    coefficients = [int.from_bytes(secret, "big")] + [rng.randrange(FIELD_PRIME) for _ in range(t - 1)]
    shares = {}
    for position, holder in enumerate(holders):
        x, value = position + 1, 0
        for c in reversed(coefficients):
            value = (value * x + c) % FIELD_PRIME
        shares[holder] = value
    return shares


def shamir_rebuild(points: dict[int, int]) -> bytes:
    """The secret from shares {x: value} (Lagrange interpolation at 0)."""
    total = 0
    for x, value in points.items():
        num, den = 1, 1
        for other in points:
            if other != x:
                num = num * (-other) % FIELD_PRIME
                den = den * (x - other) % FIELD_PRIME
        total = (total + value * num * pow(den, -1, FIELD_PRIME)) % FIELD_PRIME
    if total >> 256:  # fewer than t shares (or wrong ones) give a random field element, almost surely this large
        raise UserError("the shares do not rebuild a 32-byte secret: too few or wrong shares")
    return total.to_bytes(32, "big")


def setup_shares(client: int, keys: ClientKeys, graph: dict[int, list[int]], t: int) -> dict[int, tuple[int, int, int]]:
    """What client i sends its neighbours at setup: holder -> (x, share of sk_i, share of b_i)."""
    holders = graph[client]
    of_key = shamir_shares(keys.private_bytes, holders, t)
    of_mask = shamir_shares(keys.self_mask_seed, holders, t)
    return {holder: (position + 1, of_key[holder], of_mask[holder]) for position, holder in enumerate(holders)}


def masked_input(
    client: int, x: np.ndarray, keys: ClientKeys, graph: dict[int, list[int]], public_keys: dict[int, bytes]
) -> np.ndarray:
    """y_i = x_i + PRG(b_i) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij), on the ring."""
    y = np.asarray(x, dtype=np.uint64) + prg(keys.self_mask_seed, x.size)
    for j in graph[client]:
        mask = prg(pairwise_seed(keys.private_bytes, public_keys[j]), x.size)
        y = y + mask if j > client else y - mask
    return y


def revealed_shares(
    holder: int, held: dict[int, tuple[int, int, int]], survivors: set[int]
) -> dict[int, tuple[str, int, int]]:
    """What a surviving holder reveals in the unmasking round: for each client it holds shares of,
    (kind, x, share): the self-mask seed's share for a survivor, the key's share for a dropped client."""
    return {i: ("mask", x, b) if i in survivors else ("key", x, sk) for i, (x, sk, b) in held.items()}


def survivors_message(survivors: frozenset[int], round_id: bytes) -> bytes:
    """What a client signs in the consistency check: the round id and the survivor set it was shown."""
    ids = np.sort(np.fromiter(survivors, dtype=np.int64, count=len(survivors))).astype(">i8").tobytes()
    return b"ssp secure aggregation survivors\0" + round_id + hashlib.sha256(ids).digest()


def sign_survivors(keys: ClientKeys, survivors: frozenset[int], round_id: bytes) -> bytes:
    """The client's Ed25519 signature on (survivor set, round id)."""
    return keys.signing_key.sign(survivors_message(survivors, round_id))


def valid_signers(
    survivors: frozenset[int], round_id: bytes, signatures: dict[int, bytes], verify_keys: dict[int, bytes]
) -> int:
    """How many members of `survivors` signed exactly that set for this round."""
    message, valid = survivors_message(survivors, round_id), 0
    for signer, signature in signatures.items():
        if signer in survivors and signer in verify_keys:
            try:
                Ed25519PublicKey.from_public_bytes(verify_keys[signer]).verify(signature, message)
                valid += 1
            except InvalidSignature:
                pass
    return valid


def consistent(holder: int, survivors: frozenset[int], signers: int, quorum: int) -> bool:
    """The consistency check on a holder's side: it is in the set it was shown, the set has at
    least the quorum, and at least the quorum of its members signed it (`valid_signers`)."""
    return holder in survivors and len(survivors) >= quorum and signers >= quorum


def quorum(clients: int, min_clients: int) -> int:
    """The survivors a round needs: the min_clients its noise is planned for, and more than half
    of the clients (two sets each signed by that many honest clients then share a signer)."""
    return max(min_clients, clients // 2 + 1)


def mask_correction(
    client: int,
    kind: str,
    secret: bytes,
    *,
    size: int,
    graph: dict[int, list[int]],
    public_keys: dict[int, bytes],
    survivors: set[int],
) -> np.ndarray:
    """What the server subtracts for one client once its secret is rebuilt: a survivor's self-mask,
    or the masks a dropped client shared with its surviving neighbours (as they added them)."""
    if kind == "mask":
        return prg(secret, size)
    correction = np.zeros(size, dtype=np.uint64)
    for j in graph[client]:
        if j in survivors:  # j added +PRG(s_ij) if j < i (i is its larger neighbour), else -PRG(s_ij)
            mask = prg(pairwise_seed(secret, public_keys[j]), size)
            correction = correction + mask if j < client else correction - mask
    return correction


def encode(x: np.ndarray, scale: float) -> np.ndarray:
    """Real vector -> ring elements: x * scale truncated towards 0 (|each| never grows, so norm
    bounds survive), as two's complement."""
    scaled = np.trunc(np.asarray(x, dtype=np.float64) * scale)
    if scaled.size and np.abs(scaled).max() >= 2.0 ** (RING_BITS - 2):
        raise UserError(f"fixed-point scale {scale:g} puts values out of the ring's range")
    return scaled.astype(np.int64).view(np.uint64)


def decode(total: np.ndarray, scale: float) -> np.ndarray:
    """Ring elements (a sum of encoded vectors, within the signed range) -> reals."""
    return np.asarray(total, dtype=np.uint64).view(np.int64).astype(np.float64) / scale
