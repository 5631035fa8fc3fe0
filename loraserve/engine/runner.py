"""Tensors in, tokens out: turns a scheduled batch into one forward pass and samples.

Sequences are ordered by LoRA slot so that each adapter's tokens are one contiguous segment
(the grouped LoRA op relies on it); the model only ever sees slot indices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraserve.config import EngineConfig
from loraserve.model.attention import AttentionMetadata, PrefillSeq
from loraserve.model.llama import LlamaModel, LoraHook
from loraserve.model.sampler import SampleResult, sample
from loraserve.request import Request

# Builds the LoRA hook of one step from (slot, num_tokens) per sequence, in batch order;
# returns None for a base-only batch (which then pays nothing for LoRA).
LoraHookFactory = Callable[[list[tuple[int, int]]], LoraHook | None]


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig, num_blocks: int):
        self.model = model
        self.block_size = config.block_size
        c = model.config
        slots = num_blocks * config.block_size
        shape = (slots, c.num_key_value_heads, c.head_dim)
        # One tensor per layer: writes through views of one big tensor are slow when compiled.
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape))
                          for _ in range(c.num_hidden_layers)]
        self.kv_bytes = 2 * c.num_hidden_layers * slots * c.num_key_value_heads * c.head_dim * 4

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def execute(
        self,
        entries: list[tuple[Request, int]],
        slot_of: Callable[[Request], int],  # LoRA slot of a request, -1 for the base model
        generators: dict[str, torch.Generator],
        lora_factory: LoraHookFactory | None = None,
    ) -> list[tuple[Request, int, float | None, dict | None]]:
        """Run one step. Returns (request, sampled token, logprob, top logprobs) for every
        request whose known tokens are now all computed (mid-prefill chunks sample nothing)."""
        order = sorted(entries, key=lambda e: slot_of(e[0]))  # stable: FCFS within an adapter
        ids: list[int] = []
        pos: list[int] = []
        slot_mapping: list[int] = []
        prefills: list[PrefillSeq] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        logits_rows: list[int] = []
        samplers: list[Request] = []
        segments: list[tuple[int, int]] = []
        for req, n in order:
            c = req.num_computed_tokens
            row = len(ids)
            ids.extend(req.all_token_ids[c : c + n])
            pos.extend(range(c, c + n))
            slot_mapping.extend(self._slots(req.block_table, c, c + n))
            segments.append((slot_of(req), n))
            if n == 1:
                dec_rows.append(row)
                dec_tables.append(req.block_table)
                dec_lens.append(c + 1)
            else:
                nb = -(-(c + n) // self.block_size)  # blocks holding its context
                ctx = None if c == 0 else torch.tensor(req.block_table[:nb])
                prefills.append(PrefillSeq(row, row + n, ctx, c + n))
            if c + n == req.num_tokens:
                logits_rows.append(row + n - 1)
                samplers.append(req)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping),
            decode_rows=None, decode_blocks=None, decode_mask=None,
            decode_contiguous=False, prefills=prefills, block_size=self.block_size,
        )
        if dec_rows:
            self._decode_metadata(meta, dec_rows, dec_tables, dec_lens)
        lora = lora_factory(segments) if lora_factory is not None else None
        with torch.inference_mode():
            logits = self.model.forward(
                torch.tensor(ids), torch.tensor(pos), self.kv_caches, meta,
                torch.tensor(logits_rows, dtype=torch.long), lora,
            )
            if not samplers:
                return []
            params = [r.params for r in samplers]
            gens = [generators.get(r.request_id) for r in samplers]
            res: SampleResult = sample(logits, params, gens)
        out = []
        for i, req in enumerate(samplers):
            lp = res.logprobs[i] if res.logprobs is not None else None
            top = res.top_logprobs[i] if res.top_logprobs is not None else None
            out.append((req, res.token_ids[i], lp, top))
        return out

    def _decode_metadata(self, meta: AttentionMetadata, rows: list[int],
                         tables: list[list[int]], lens: list[int]) -> None:
        bs = self.block_size
        max_blocks = -(-max(lens) // bs)
        # [Bd, nb]: only the blocks that hold context (a table may own one more, empty block)
        meta.decode_blocks = torch.tensor(
            [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in tables])
        lmax = max_blocks * bs
        lens_t = torch.tensor(lens).unsqueeze(1)
        meta.decode_mask = (torch.arange(lmax).unsqueeze(0) < lens_t).view(len(rows), 1, 1, lmax)
        meta.decode_rows = torch.tensor(rows)
        meta.decode_contiguous = rows == list(range(len(rows)))
