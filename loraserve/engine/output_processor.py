"""Sampled tokens -> text: incremental detokenization, stop strings, RequestOutputs.

Per-request detokenizer state lives here and is dropped when the request ends. Token-level
stops (EOS, stop ids, lengths) were decided by the scheduler; stop strings are decided here.
"""

from __future__ import annotations

from loraserve.model.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from loraserve.request import Request
from loraserve.types import FinishReason, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._state: dict[str, tuple[IncrementalDetokenizer, StopChecker]] = {}

    def process(self, sampled: list[Request]) -> list[Request]:
        """Add each request's newest token to its text. Returns the still-running requests
        that a stop string ended (their finish_reason is set; the caller ends them)."""
        stopped = []
        for req in sampled:
            was_running = req.finish_reason is None
            self._add_text(req)
            if was_running and req.finish_reason is not None:
                stopped.append(req)
        return stopped

    def _add_text(self, req: Request) -> None:
        if not req.output_token_ids:  # it only scored its prompt
            self.drop(req.request_id)
            return
        detok, stops = self._state.get(req.request_id) or self._new_state(req)
        stop_token = req.finish_reason is FinishReason.STOP  # EOS or a stop id: not text
        prev = len(req.text)
        if not stop_token:
            req.text += detok.add(req.output_token_ids[-1])
        if req.finish_reason is not None:
            req.text += detok.flush()  # whatever was held back for a partial character
        if stops and len(req.text) > prev:
            if req.num_output_tokens <= req.params.min_tokens:
                stops.floor = len(req.text)  # no stop string may start in the first min_tokens
            else:
                cut = stops.find(req.text, len(req.text) - prev)
                if cut is not None:
                    req.text = req.text[:cut]
                    req.finish_reason = FinishReason.STOP
                else:
                    req.holdback = stops.holdback(req.text)
        if req.finish_reason is not None:
            req.holdback = 0
            self.drop(req.request_id)

    def _new_state(self, req: Request) -> tuple[IncrementalDetokenizer, StopChecker]:
        state = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
                 StopChecker(req.params.stop))
        self._state[req.request_id] = state
        return state

    def tracked_ids(self) -> list[str]:
        """Requests it keeps detokenizer state for (the invariant check's view)."""
        return list(self._state)

    def drop(self, request_id: str) -> None:
        self._state.pop(request_id, None)


def to_output(req: Request) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        text=req.text,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        error=req.error,
        error_status=req.error_status,
        lora_name=req.lora_name,
        adapter_version=req.adapter_version,
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        top_logprobs=list(req.top_logprobs) if req.params.logprobs else None,
        prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        holdback=req.holdback,
        num_cached_tokens=req.num_cached_tokens or 0,
    )
