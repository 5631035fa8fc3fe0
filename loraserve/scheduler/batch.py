"""Value objects between the scheduler and the model runner: what runs, and what came out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from loraserve.request import Request
from loraserve.types import FinishReason, PromptLogprob


class ScheduledSeq(NamedTuple):
    request: Request
    num_tokens: int  # tokens it feeds this step: a prompt chunk, a recompute, or 1 (decode)


@dataclass
class ScheduledBatch:
    entries: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # (src, dst) KV blocks to copy before the forward: a fork's copy of its parent's last,
    # partial prompt block (the full ones are shared)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # from the waiting queue this step
    num_decodes: int = 0  # entries that are decodes (the first ones); the rest is prefill
    # the first entries, decodes the step protects (row_share.py); the rest is paced work
    num_protected: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @property
    def adapter_uids(self) -> set[int]:
        """The adapters this step runs (base model excluded): each needs a slot."""
        return {r.adapter_uid for r, _ in self.entries if r.adapter_uid is not None}

    def add(self, req: Request, num_tokens: int) -> None:
        self.entries.append(ScheduledSeq(req, num_tokens))

    def add_decode(self, req: Request) -> None:
        """A paced decode: after the decodes already in, before any prefill."""
        self.entries.insert(self.num_decodes, ScheduledSeq(req, 1))
        self.num_decodes += 1

    def drop(self, req: Request) -> None:
        i = next((i for i, e in enumerate(self.entries) if e.request is req), None)
        if i is None:
            return
        del self.entries[i]
        self.num_decodes -= i < self.num_decodes
        self.num_protected -= i < self.num_protected

    def unfinished(self) -> ScheduledBatch:
        """Its entries whose request has not ended (a run's later steps: decode_runs.py)."""
        return ScheduledBatch([e for e in self.entries if not e.request.is_finished])

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass(frozen=True)
class StepOutput:
    """What one forward pass produced: a token for every request whose known tokens are now
    all computed (mid-prefill chunks sample nothing), in the order of `request_ids`."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float] | None = None  # chosen token's logprob per row, if any row asked
    top_logprobs: list[dict[int, float] | None] | None = None
    # requests scoring their prompt: (prompt position, its logprob) for the positions computed
    prompt_logprobs: dict[str, list[tuple[int, PromptLogprob]]] = field(default_factory=dict)
    # requests that end without a token this step (their grammar allowed none), and why
    ended: tuple[tuple[str, FinishReason], ...] = ()

    @classmethod
    def empty(cls) -> StepOutput:
        return cls([], [])

    def only(self, request_ids: set[str]) -> StepOutput:
        """The tokens of these requests alone (a greedy run's step: token ids only)."""
        keep = [i for i, rid in enumerate(self.request_ids) if rid in request_ids]
        return StepOutput([self.request_ids[i] for i in keep], [self.token_ids[i] for i in keep])

    @classmethod
    def concat(cls, parts: list[StepOutput]) -> StepOutput:
        """The outputs of several runs of disjoint requests, as one."""
        ids = [r for p in parts for r in p.request_ids]
        tokens = [t for p in parts for t in p.token_ids]
        with_lp = any(p.logprobs is not None for p in parts)
        lps = [lp for p in parts for lp in (p.logprobs or [None] * len(p.request_ids))]
        tops = [t for p in parts for t in (p.top_logprobs or [None] * len(p.request_ids))]
        scores = {rid: v for p in parts for rid, v in p.prompt_logprobs.items()}
        ended = tuple(e for p in parts for e in p.ended)
        return cls(ids, tokens, lps if with_lp else None, tops if with_lp else None,
                   prompt_logprobs=scores, ended=ended)
