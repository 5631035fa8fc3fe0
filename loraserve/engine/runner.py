"""Tensors in, tokens out: one scheduled batch -> one forward pass -> a StepOutput.

Sequences are ordered by LoRA slot so that each adapter's tokens are one contiguous segment
(the segmented LoRA op relies on it); the model only ever sees slot indices. Every tensor is
made on the engine's device; attention and LoRA each build their own per-step metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from loraserve.config import EngineConfig
from loraserve.engine.cuda_graphs import DecodeGraphs
from loraserve.lora.backends import LoraBackend
from loraserve.model.attention import AttentionBackend, AttentionSeq
from loraserve.model.llama import LlamaModel
from loraserve.model.prompt_logprobs import score_tokens
from loraserve.model.sampler import SampleResult, sample
from loraserve.model.structured import GrammarMasker
from loraserve.ops.native_lora import NativeLoraStep
from loraserve.request import Request
from loraserve.scheduler.batch import ScheduledBatch, StepOutput
from loraserve.types import FinishReason, PromptLogprob


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig, num_blocks: int,
                 device: torch.device, attention: AttentionBackend, lora: LoraBackend,
                 eos_token_ids: frozenset[int] = frozenset(), scratch_block: bool = False):
        self.model = model
        self.eos_token_ids = eos_token_ids  # masked while a request is below its min_tokens
        self.device = device
        self.attention = attention
        self.lora = lora
        c = model.config
        self.block_size = config.block_size
        # scratch_block: one block more than the KV manager hands out, where the padding rows
        # of a replayed decode graph write their K/V (cuda_graphs.py)
        self.scratch_slot = num_blocks * config.block_size if scratch_block else None
        shape = ((num_blocks + scratch_block) * config.block_size, c.num_key_value_heads,
                 c.head_dim)
        # One tensor per layer: writes through views of one big tensor are slow when compiled.
        dt = model.embed.dtype  # the KV cache holds what the model computes
        self.kv_caches = [(torch.zeros(shape, device=device, dtype=dt),
                           torch.zeros(shape, device=device, dtype=dt))
                          for _ in range(c.num_hidden_layers)]
        # Requests without a seed of their own sample from this one (reproducible per run).
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        self.graphs: DecodeGraphs | None = None
        self.masker = GrammarMasker(c.vocab_size)  # structured outputs' token masks

    def enable_decode_graphs(self, max_bs: int, max_model_len: int, new_graph=None,
                             capture_now: bool = True) -> None:
        """Replay decode steps of up to max_bs sequences from recorded graphs (cuda_graphs.py);
        new_graph: None for CUDA graphs (one memory pool per engine), or ReplayEmulator to check
        the same on a CPU."""
        max_blocks = -(-max_model_len // self.block_size)
        if self.scratch_slot is None:  # made without one (tests): add it, before any step
            self.scratch_slot = self.kv_caches[0][0].shape[0]
            self.kv_caches = [(torch.cat([k, k.new_zeros((self.block_size, *k.shape[1:]))]),
                               torch.cat([v, v.new_zeros((self.block_size, *v.shape[1:]))]))
                              for k, v in self.kv_caches]
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.attention, self.lora,
                                   max_bs, max_blocks, self.scratch_slot, new_graph)
        if capture_now:
            with torch.inference_mode():
                self.graphs.capture_all()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (src -> dst) in every layer: a fork's own copy of the partial
        block it shares with its parent, before either writes past the shared tokens."""
        if not copies:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in copies]).to(self.device)
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in copies]).to(self.device)
        with torch.inference_mode():
            for k, v in self.kv_caches:
                k[dst] = k[src]
                v[dst] = v[src]

    def rng_states(self, batch: ScheduledBatch) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The sampling RNGs this batch may draw from, with their states (to replay a step)."""
        gens = [self.generator] + [r.generator for r, _ in batch.entries
                                   if r.generator is not None]
        return [(g, g.get_state()) for g in gens]

    @staticmethod
    def restore_rng_states(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for g, state in states:
            g.set_state(state)

    def execute(self, batch: ScheduledBatch, slots: Mapping[int, int]) -> StepOutput:
        """Run one step. `slots`: LoRA slot of each adapter uid in the batch (store.bind)."""
        # stable sort: FCFS order within an adapter
        order = sorted(batch.entries, key=lambda e: _slot_of(e.request, slots))
        ids: list[int] = []
        pos: list[int] = []
        attn_seqs: list[AttentionSeq] = []
        seq_slots: list[tuple[int, int]] = []
        sample_rows: list[int] = []
        samplers = []
        scored: list[tuple[Request, int, int]] = []  # (request, prompt position, logits row)
        for req, n in order:
            c = req.num_computed_tokens
            # a prompt's lone token (the budget left one, or its last) is still a prompt row:
            # the C kernels agree bit for bit, but a prompt that goes to torch's SDPA (a
            # window, a soft cap) does not agree with the decode kernel
            prompt = len(req.prompt_token_ids)
            attn_seqs.append(AttentionSeq(len(ids), n, c, req.block_table,
                                          prompt_chunk=prompt > 1 and c < prompt))
            seq_slots.append((_slot_of(req, slots), n))
            if req.wants_prompt_logits:  # row of position p predicts prompt token p + 1
                last = min(c + n, len(req.prompt_token_ids) - 1)
                scored += [(req, p + 1, len(ids) + p - c) for p in range(c, last)]
            ids.extend(req.all_token_ids[c : c + n])
            pos.extend(range(c, c + n))
            # its known tokens are all computed: it samples (unless it only scores a prompt)
            if c + n == req.num_tokens and req.params.max_tokens > 0:
                sample_rows.append(len(ids) - 1)
                samplers.append(req)
        logits_rows = [row for _, _, row in scored] + sample_rows
        dev = self.device
        # constrained rows' masks are filled on other threads while the forward pass runs
        pending = self.masker.start([r.grammar for r in samplers])
        with torch.inference_mode():
            # a captured graph has no adapter parts beyond B @ A: such steps run eagerly
            if (self.graphs is not None and self.graphs.fits(attn_seqs, len(samplers))
                    and not self.lora.has_extras(seq_slots)):
                logits = self.graphs.run(ids, pos, attn_seqs, seq_slots)
            else:
                plan = self.lora.plan(seq_slots)
                hook = self.lora.step(plan)  # None: base-only
                logits = self.model.forward(
                    torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                    self.kv_caches, self.attention, self.attention.prepare(attn_seqs),
                    torch.tensor(logits_rows, dtype=torch.long, device=dev), hook,
                )
            scores = self._prompt_scores(scored, logits[: len(scored)])
            logits = logits[len(scored):]
            if not samplers:
                return StepOutput([], [], prompt_logprobs=scores)
            gens = [self.generator if r.generator is None else r.generator for r in samplers]
            res = sample(logits.float(), [r.params for r in samplers], gens,
                         [r.prompt_token_ids for r in samplers],
                         [r.output_token_ids for r in samplers], self.eos_token_ids,
                         pending)
        if pending is None:
            return StepOutput([r.request_id for r in samplers], res.token_ids, res.logprobs,
                              res.top_logprobs, prompt_logprobs=scores)
        return _advance_grammars(samplers, res, scores)

    def greedy_run(self, batch: ScheduledBatch, slots: Mapping[int, int]) -> GreedyRun | None:
        """`batch` prepared for several steps in one call, or None where it cannot take them:
        the native decode loop with its greedy head, decodes whose token is their logits'
        first maximum, asking for nothing else of them (no logprobs, penalties, biases,
        min_tokens or grammar), adapters only where the loop runs their LoRA kernel (plain
        LoRA over quantized weights, `NativeDecode.takes_lora`)."""
        native = self.model.native
        if (native is None or native.greedy_head is None
                or not native.fits_attention(self.attention)
                or not all(n == 1 and _plain_greedy(req) for req, n in batch.entries)):
            return None
        order = sorted((req for req, _ in batch.entries),  # by slot, as `execute` orders
                       key=lambda r: _slot_of(r, slots))
        seq_slots = [(_slot_of(r, slots), 1) for r in order]
        hook = self.lora.step(self.lora.plan(seq_slots))  # None: base-only
        if hook is None:
            return GreedyRun(order, None, None)
        if not native.takes_lora or self.lora.has_extras(seq_slots):
            return None
        op = hook.native()
        return None if op is None else GreedyRun(order, op, hook)

    def execute_greedy_run(self, run: GreedyRun, steps: int) -> list[StepOutput]:
        """`steps` decode steps of a prepared run in one call, each step's tokens as its own
        StepOutput; every request's blocks already hold all of the steps' K/V."""
        reqs = run.requests
        with torch.inference_mode():
            tokens = self.model.native.greedy(
                [r.all_token_ids[-1] for r in reqs], [r.num_computed_tokens for r in reqs],
                [r.block_table for r in reqs], steps, self.kv_caches, self.attention,
                self.model.ropes[0].max_positions, run.lora)
        ids = [r.request_id for r in reqs]
        return [StepOutput(ids, row) for row in tokens]

    @staticmethod
    def _prompt_scores(scored: list[tuple[Request, int, int]],
                       logits: torch.Tensor) -> dict[str, list[tuple[int, PromptLogprob]]]:
        """Each scored row's target logprob, by request: (prompt position, value)."""
        if not scored:
            return {}
        targets = [req.prompt_token_ids[p] for req, p, _ in scored]
        values = score_tokens(logits, targets, [req.params.prompt_logprobs for req, _, _ in scored])
        out: dict[str, list[tuple[int, PromptLogprob]]] = {}
        for (req, p, _), v in zip(scored, values, strict=True):
            out.setdefault(req.request_id, []).append((p, v))
        return out


class GreedyRun(NamedTuple):
    """A batch prepared for several decode steps in one call (ModelRunner.greedy_run)."""

    requests: list[Request]  # in the order of their LoRA slots
    lora: NativeLoraStep | None  # the adapters' op for the C loop; None: base-only
    hook: object  # the step whose tensors `lora` points into: alive for the call


def _slot_of(req: Request, slots: Mapping[int, int]) -> int:
    """The request's LoRA slot this step (store.bind), -1 for the base model."""
    return -1 if req.adapter_uid is None else slots[req.adapter_uid]


def _plain_greedy(req: Request) -> bool:
    """A decode past its prompt whose next token is its logits' first maximum."""
    p = req.params
    return (req.num_output_tokens > 0 and p.greedy and not p.processes_logits
            and p.logprobs is None and req.grammar is None)


def _advance_grammars(samplers: list[Request], res: SampleResult,
                      scores: dict[str, list[tuple[int, PromptLogprob]]]) -> StepOutput:
    """Feed each constrained row's token to its matcher; rows left with no allowed token end
    without one: "stop" when their grammar was complete, else grammar_dead_end."""
    dead = set(res.dead)
    keep = [i for i in range(len(samplers)) if i not in dead]
    for i in keep:
        if samplers[i].grammar is not None:
            samplers[i].grammar.consume_token(res.token_ids[i])
    ended = tuple((samplers[i].request_id,
                   FinishReason.STOP if samplers[i].grammar.is_accepting()
                   else FinishReason.GRAMMAR_DEAD_END) for i in sorted(dead))

    def pick(values):
        return None if values is None else [values[i] for i in keep]

    return StepOutput([samplers[i].request_id for i in keep], pick(res.token_ids),
                      pick(res.logprobs), pick(res.top_logprobs), prompt_logprobs=scores,
                      ended=ended)
