"""Content hashes of full KV blocks, for the prefix cache.

A block's hash covers its parent's hash (so it names the whole prefix), its token ids, and the
namespace: the fingerprint of the weights the K/V were computed under (the base model's own,
or the adapter's content fingerprint: its config and weights, hence its scale). Never an
adapter's name, a counter or anything a client sends: the same name reloaded with other
weights is another namespace, identical files reloaded are the same one. SHA-256, so two
different prefixes never meet by accident.
"""

from __future__ import annotations

import hashlib
from array import array

BASE_NAMESPACE = b"loraserve/base"


def adapter_namespace(fingerprint: str) -> bytes:
    return b"loraserve/lora/" + fingerprint.encode()


def block_hash(parent: bytes, namespace: bytes, token_ids: list[int]) -> bytes:
    h = hashlib.sha256(parent)
    h.update(len(namespace).to_bytes(2, "little"))
    h.update(namespace)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], namespace: bytes, token_ids: list[int],
                        block_size: int, num_tokens: int) -> list[bytes]:
    """Append to `hashes` (the chain so far) the hashes of every full block within the first
    `num_tokens` of `token_ids`. Returns `hashes`."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else b""
        hashes.append(block_hash(parent, namespace,
                                 token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
