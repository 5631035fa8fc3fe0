"""Per-request block tables over the block pool, with check/commit pairs for the scheduler."""

from __future__ import annotations

from loraserve.kvcache.block_pool import BlockPool
from loraserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def _blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(self._blocks_needed(req, num_new_tokens))

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        req.block_table.extend(self.pool.allocate(self._blocks_needed(req, num_new_tokens)))

    def free(self, req: Request) -> None:
        """Give back every block of `req`; safe to call twice (the table is emptied)."""
        blocks, req.block_table = req.block_table, []
        self.pool.free(blocks)
