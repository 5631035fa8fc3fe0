"""A pool of fixed-size KV blocks: ids, refcounts and the prefix-cache index; the tensors live
with the runner.

Invariants:
- a block with refcount > 0 is held by that many requests (forks and prefix hits share
  blocks) and is never handed out again;
- a block with refcount 0 is in the free queue, oldest-freed first (LRU). If it still holds a
  cached full block (it has a hash), a later request may take it back from the queue; it is
  evicted (its hash forgotten) only when `allocate` hands it out for new contents;
- a hash maps to at most one block, and that block's contents are exactly the tokens the hash
  names, computed under the namespace (adapter weights) the hash includes.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, bytes] = {}  # block -> the hash of its cached contents
        self._block_of: dict[bytes, int] = {}  # hash -> block
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they are reusable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for new contents, least recently freed first (evicting cached ones)."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked {n}, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._forget(b)
            self.ref[b] = 1
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each block (a prefix hit or a fork); free ones leave the queue."""
        for b in blocks:
            if self.ref[b] == 0:
                del self._free[b]
            self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block. Given in the order they should be evicted: the
        caller passes a request's table tail first, so a shared prefix outlives its tails."""
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._free[b] = None

    # --- the prefix-cache index -----------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record that a held, full `block` holds the contents `block_hash` names. A block
        already cached, or a hash already held by another block, is left as it is."""
        if block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            self.num_evictions += 1

    def check(self) -> list[str]:
        """This pool's own consistency (the invariants above); each problem in words."""
        problems = []
        held_free = [b for b in self._free if self.ref[b] != 0]
        if held_free:
            problems.append(f"KV blocks {held_free[:8]} are in the free queue with refcount > 0")
        lost = [b for b, r in enumerate(self.ref) if r == 0 and b not in self._free]
        if lost:
            problems.append(f"KV blocks {lost[:8]} have refcount 0 but are not free (leaked)")
        negative = [b for b, r in enumerate(self.ref) if r < 0]
        if negative:
            problems.append(f"KV blocks {negative[:8]} have a negative refcount")
        if len(self._hash_of) != len(self._block_of) or any(
                self._block_of.get(h) != b for b, h in self._hash_of.items()):
            problems.append("the prefix-cache index is not one hash per block")
        return problems

    def reset_cache(self) -> int:
        """Forget every cached block that no request holds. Returns how many."""
        idle = [b for b in self._hash_of if self.ref[b] == 0]
        for b in idle:
            self._forget(b)
        return len(idle)
