"""Per-request block tables over the block pool: prefix-cache matching, forks, and check/commit
pairs for the scheduler (the vLLM `get_computed_blocks` / `allocate_slots` pattern).

A request that holds no blocks (new, or preempted) first looks for its prefix: `find_prefix`
is a pure query returning the blocks it may reuse, from the prefix cache (full blocks whose
hash chain matches, under the request's namespace) or from its fork parent (the parent's
prompt blocks, the last partial one to be copied). `can_allocate(req, n, prefix)` says whether
the rest fits; `allocate(req, n, prefix)` commits both. At least one prompt token is always
left to compute: its logits are what the request samples from.

Prompt blocks a running request is still computing are known by hash (`_computing`): a
request whose next block is one of them waits (`waits_for_prefix`) rather than computing the
same K/V a second time in the same steps (SGLang's in-batch prefix check); it is admitted as
soon as those blocks are cached, or when their producer leaves (preempted, aborted, ended).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from loraserve.kvcache.block_pool import BlockPool
from loraserve.kvcache.prefix_hash import extend_block_hashes
from loraserve.request import Request, RequestStatus


@dataclass(frozen=True)
class Prefix:
    """K/V a request can reuse instead of computing: `blocks` are shared as they are; with
    `copy_from`, the block after them is a copy of that (partial) block of a fork parent."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    copy_from: int | None = None


NO_PREFIX = Prefix()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # (src, dst) block copies the runner must make before the next forward (forks)
        self.pending_copies: list[tuple[int, int]] = []
        # prompt blocks being computed, by hash: how many running requests compute each, and
        # which ones each request computes (request id -> hashes)
        self._computing: Counter[bytes] = Counter()
        self._computing_by: dict[str, list[bytes]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    # --- checks (no side effects) -----------------------------------------------------------
    def find_prefix(self, req: Request) -> Prefix:
        if req.block_table or req.wants_prompt_logits:  # reused K/V would have no logits
            return NO_PREFIX
        limit = (req.num_tokens - 1) // self.block_size  # leave a token to compute
        parent = req.fork_parent
        if parent is not None and parent.status is RequestStatus.RUNNING:
            n = len(req.prompt_token_ids) - 1
            if parent.num_computed_tokens >= n and len(parent.block_table) * self.block_size > n:
                full, rest = divmod(n, self.block_size)
                return Prefix(parent.block_table[:full], n,
                              parent.block_table[full] if rest else None)
        if not self.enable_prefix_caching or limit == 0:
            return NO_PREFIX
        hashes = self._hashes(req, limit * self.block_size)
        blocks = []
        for h in hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return Prefix(blocks, len(blocks) * self.block_size) if blocks else NO_PREFIX

    def waits_for_fork(self, req: Request) -> bool:
        """A fork whose parent is still computing the shared prompt: admitting it now would
        compute the prompt twice."""
        parent = req.fork_parent
        return (parent is not None and not req.block_table and not parent.is_finished
                and parent.num_computed_tokens < len(req.prompt_token_ids) - 1)

    def waits_for_prefix(self, req: Request, prefix: Prefix) -> bool:
        """The first prompt block `req` would compute is being computed by a running request
        under the same namespace: wait for it to be cached instead of computing it again."""
        if (not self._computing or req.block_table or prefix.copy_from is not None
                or req.wants_prompt_logits):
            return False
        k = len(prefix.blocks)
        if k >= (req.num_tokens - 1) // self.block_size:
            return False
        return self._computing[self._hashes(req, (k + 1) * self.block_size)[k]] > 0

    def _blocks_needed(self, req: Request, num_new_tokens: int, prefix: Prefix) -> int:
        total = max(req.num_computed_tokens, prefix.num_tokens) + num_new_tokens
        held = len(req.block_table) + len(prefix.blocks)
        return max(0, -(-total // self.block_size) - held)

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks `allocate(req, num_new_tokens)` takes from the pool (a running request)."""
        return self._blocks_needed(req, num_new_tokens, NO_PREFIX)

    def can_allocate(self, req: Request, num_new_tokens: int, prefix: Prefix = NO_PREFIX) -> bool:
        # Reused blocks nobody holds leave the free queue too.
        idle = sum(1 for b in prefix.blocks if self.pool.ref[b] == 0)
        return self.pool.can_allocate(self._blocks_needed(req, num_new_tokens, prefix) + idle)

    # --- commits ----------------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int, prefix: Prefix = NO_PREFIX) -> None:
        new = self._blocks_needed(req, num_new_tokens, prefix)
        if prefix.num_tokens:
            self.pool.share(prefix.blocks)
            req.block_table.extend(prefix.blocks)
            req.num_computed_tokens = prefix.num_tokens
        starting = not req.block_table
        fresh = self.pool.allocate(new)
        if starting and self.enable_prefix_caching:
            self._promise(req, len(prefix.blocks))
        if prefix.copy_from is not None:
            self.pending_copies.append((prefix.copy_from, fresh[0]))
        req.block_table.extend(fresh)
        if req.num_cached_tokens is None:  # what the client sees: the first admission's
            req.num_cached_tokens = prefix.num_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Index the request's blocks that became full of computed K/V (after a step)."""
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_indexed_blocks:
            return
        hashes = self._hashes(req, full * self.block_size)
        for i in range(req.num_indexed_blocks, full):
            self.pool.cache(req.block_table[i], hashes[i])
        req.num_indexed_blocks = full

    def _promise(self, req: Request, first: int) -> None:
        # The full prompt blocks this request will compute, from `first` on.
        full = len(req.prompt_token_ids) // self.block_size
        if full <= first:
            return
        hashes = self._hashes(req, full * self.block_size)[first:full]
        self._computing.update(hashes)
        self._computing_by[req.request_id] = hashes

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, req: Request) -> None:
        """Give back every block of `req`, tail first (so shared prefixes are evicted last);
        safe to call twice (the table is emptied)."""
        blocks, req.block_table = req.block_table, []
        req.num_indexed_blocks = 0
        for h in self._computing_by.pop(req.request_id, ()):
            self._computing[h] -= 1
            if not self._computing[h]:
                del self._computing[h]
        self.pool.free(blocks[::-1])

    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        if len(req.block_hashes) * self.block_size < num_tokens:
            extend_block_hashes(req.block_hashes, req.cache_namespace, req.all_token_ids,
                                self.block_size, num_tokens)
        return req.block_hashes

    def check(self, live: Iterable[Request]) -> list[str]:
        """Every block is free, cached-and-free, or held by exactly as many of the `live`
        requests (waiting and running; forks and prefix hits share) as its refcount says."""
        problems = self.pool.check()
        holders: Counter[int] = Counter()
        ids = set()
        for r in live:
            ids.add(r.request_id)
            holders.update(r.block_table)
            if len(r.block_table) * self.block_size < r.num_computed_tokens:
                problems.append(f"{r.request_id}: {r.num_computed_tokens} computed tokens "
                                f"in {len(r.block_table)} blocks")
            if r.num_indexed_blocks > len(r.block_table):
                problems.append(f"{r.request_id}: more blocks indexed than held")
        wrong = [(b, ref, holders[b]) for b, ref in enumerate(self.pool.ref)
                 if ref != holders[b]]
        for b, ref, n in wrong[:8]:
            problems.append(f"KV block {b}: refcount {ref}, held by {n} live requests")
        promised = Counter(h for hs in self._computing_by.values() for h in hs)
        if promised != self._computing:
            problems.append("prompt blocks in computation disagree with their producers")
        gone = set(self._computing_by) - ids
        if gone:
            problems.append(f"requests no longer live still compute prompt blocks: "
                            f"{sorted(gone)[:4]}")
        if self.pending_copies:
            problems.append(f"{len(self.pending_copies)} block copies left between steps")
        return problems
