"""RequestOutput -> OpenAI choices (full or streamed deltas), logprobs and SSE framing."""

from __future__ import annotations

import json

from loraserve.types import FinishReason, RequestOutput


def finish_reason(out: RequestOutput) -> str | None:
    if not out.finished or out.finish_reason is None:
        return None
    return out.finish_reason.value  # stop | length | abort | error


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class LogprobFormatter:
    """Token strings for logprobs; decoded one token at a time (cheap on small outputs)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def completion(self, out: RequestOutput, start: int, end: int, offset: int) -> dict | None:
        """The legacy completions shape for output tokens [start, end)."""
        if out.logprobs is None:
            return None
        tokens, offsets, tops = [], [], []
        for i in range(start, end):
            s = self.text(out.token_ids[i])
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if out.top_logprobs:
                tops.append({self.text(t): lp for t, lp in out.top_logprobs[i].items()})
        return {"tokens": tokens, "token_logprobs": out.logprobs[start:end],
                "top_logprobs": tops if out.top_logprobs else None, "text_offset": offsets}

    def chat(self, out: RequestOutput, start: int, end: int) -> dict | None:
        if out.logprobs is None:
            return None
        content = []
        for i in range(start, end):
            s = self.text(out.token_ids[i])
            top = []
            if out.top_logprobs:
                top = [self._entry(self.text(t), lp) for t, lp in out.top_logprobs[i].items()]
            content.append({**self._entry(s, out.logprobs[i]), "top_logprobs": top})
        return {"content": content}

    @staticmethod
    def _entry(s: str, lp: float) -> dict:
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def full_choice(index: int, out: RequestOutput, lp: LogprobFormatter, chat: bool) -> dict:
    n = len(out.token_ids)
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": out.text},
                "logprobs": lp.chat(out, 0, n), "finish_reason": finish_reason(out)}
    return {"index": index, "text": out.text, "logprobs": lp.completion(out, 0, n, 0),
            "finish_reason": finish_reason(out)}


class DeltaTracker:
    """What one choice has streamed so far; `delta(out)` gives the next chunk's choice or None.
    Text that may begin a stop string (`holdback`) is held until it is known not to."""

    def __init__(self, index: int, lp: LogprobFormatter, chat: bool):
        self.index, self.lp, self.chat = index, lp, chat
        self.sent_chars = 0
        self.sent_tokens = 0

    def delta(self, out: RequestOutput) -> dict | None:
        visible = out.text if out.finished else out.text[: len(out.text) - out.holdback]
        text = visible[self.sent_chars:] if len(visible) > self.sent_chars else ""
        end = len(out.token_ids)
        new_tokens = end > self.sent_tokens and out.logprobs is not None
        if not text and not out.finished and not new_tokens:
            return None
        if self.chat:
            logprobs = self.lp.chat(out, self.sent_tokens, end) if new_tokens else None
            choice = {"index": self.index, "delta": {"content": text} if text else {},
                      "logprobs": logprobs, "finish_reason": finish_reason(out)}
        else:
            logprobs = (self.lp.completion(out, self.sent_tokens, end, self.sent_chars)
                        if new_tokens else None)
            choice = {"index": self.index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason(out)}
        self.sent_chars += len(text)
        self.sent_tokens = end
        return choice


def is_error(out: RequestOutput) -> bool:
    return out.finish_reason is FinishReason.ERROR or out.error is not None
