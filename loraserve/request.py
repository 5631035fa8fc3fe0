"""One request's state as it moves through the engine."""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

from loraserve.types import FinishReason, PromptLogprob, SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"  # its client does not read its stream: out of scheduling, no KV
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter_uid: int | None = None,
        lora_name: str | None = None,
        generator: Any = None,
        origin: str | None = None,
        client_id: str | None = None,
        cache_namespace: bytes = b"",
        fork_parent: Request | None = None,
        grammar: Any = None,
    ):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.adapter_uid = adapter_uid  # resolved once at admission; None = base model
        self.lora_name = lora_name  # for outputs and logs only, never for lookups
        self.adapter_version: int | None = None  # the version of lora_name it is bound to
        self.generator = generator  # its own RNG (a torch.Generator) when a seed was given
        # structured outputs: its grammar matcher (advanced by each sampled token), or None
        self.grammar = grammar
        self.origin = origin  # the client request it came from (its n x prompts share one)
        # who sent it, for fairness between clients: the API key's tenant, else the
        # connection's address (None: the offline API)
        self.client_id = client_id
        # Prefix cache: the namespace of its K/V (the weights they are computed under), the
        # hash chain of its full blocks, and how many of its blocks are indexed.
        self.cache_namespace = cache_namespace
        self.block_hashes: list[bytes] = []
        self.num_indexed_blocks = 0
        self.num_cached_tokens: int | None = None  # prompt tokens reused at first admission
        self.prefix_counted = False  # its first admission is in the prefix-cache counters
        # n > 1: the sibling that computes the shared prompt; this one forks from its blocks
        self.fork_parent = fork_parent
        self.forks: list[Request] = []  # the siblings that fork from this one
        if fork_parent is not None:
            fork_parent.forks.append(self)
        self.output_token_ids: list[int] = []
        # with params.prompt_logprobs: one entry per prompt token, filled as its prefill runs
        # (None for the first token, which nothing predicts); written by position, so a
        # recompute after preemption rewrites the same values
        self.prompt_logprobs: list[PromptLogprob | None] | None = (
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in this request's blocks
        self.block_table: list[int] = []
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.error_status: int | None = None  # 4xx: the adapter it named; 500: our bug
        self.num_preemptions = 0
        self.paused_at: float | None = None  # monotonic time it was paused
        self.blocked_steps = 0  # steps spent waiting behind the adapter cap (starvation guard)
        self.text = ""  # detokenized output (maintained by the output processor)
        self.holdback = 0  # trailing chars of `text` that may start a stop string: not streamed

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prompt's positions need logits: it may reuse no cached K/V until they are done."""
        return (self.prompt_logprobs is not None
                and self.num_computed_tokens < len(self.prompt_token_ids))

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int, logprob: float | None = None,
                     top_logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
            if top_logprobs is not None:
                self.top_logprobs.append(top_logprobs)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, adapter={self.adapter_uid}, "
                f"{self.status.value}, {self.num_computed_tokens}/{self.num_tokens})")
