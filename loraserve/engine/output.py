"""Turning sampled tokens into text and deciding when a request is done."""

from __future__ import annotations

from loraserve.request import Request
from loraserve.types import FinishReason, RequestOutput


def check_stop(req: Request, token: int, eos_ids: set[int], max_model_len: int) -> None:
    """Set `req.finish_reason` if the token just appended ends the request."""
    p = req.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
        req.finish_reason = FinishReason.STOP
    elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
        req.finish_reason = FinishReason.LENGTH


def to_output(req: Request) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        text=req.text,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        error=req.error,
        lora_name=req.lora_name,
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        top_logprobs=list(req.top_logprobs) if req.params.logprobs else None,
        holdback=req.holdback,
    )
