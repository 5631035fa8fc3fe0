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
    """Token strings for logprobs; decoded one token at a time (cheap on small outputs), or
    `token_id:N` with `return_tokens_as_token_ids` (vLLM's form, for tokens that do not
    decode to text on their own)."""

    def __init__(self, tokenizer, as_token_ids: bool = False):
        self.tok = tokenizer
        self.as_token_ids = as_token_ids

    def text(self, token_id: int) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return self.tok.decode([token_id], skip_special_tokens=False)

    def prompt(self, out: RequestOutput) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id:
        {logprob, rank, decoded_token}} for the prompt's own token and the top k."""
        if out.prompt_logprobs is None:
            return None
        entries: list[dict | None] = []
        for token, score in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
            if score is None:
                entries.append(None)
                continue
            entry = {str(token): self._ranked(token, score.logprob, score.rank)}
            for rank, (t, lp) in enumerate(score.top, start=1):
                entry.setdefault(str(t), self._ranked(t, lp, rank))
            entries.append(entry)
        return entries

    def _ranked(self, token: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.text(token)}

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
        choice = {"index": index, "message": {"role": "assistant", "content": out.text},
                  "logprobs": lp.chat(out, 0, n), "finish_reason": finish_reason(out)}
    else:
        choice = {"index": index, "text": out.text, "logprobs": lp.completion(out, 0, n, 0),
                  "finish_reason": finish_reason(out)}
    return _with_prompt_logprobs(choice, out, lp)


def _with_prompt_logprobs(choice: dict, out: RequestOutput, lp: LogprobFormatter) -> dict:
    if out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = lp.prompt(out)
    return choice


class DeltaTracker:
    """What one choice has streamed so far; `delta(out)` gives the next chunk's choice or None.
    Text that may begin a stop string (`holdback`) is held until it is known not to."""

    def __init__(self, index: int, lp: LogprobFormatter, chat: bool):
        self.index, self.lp, self.chat = index, lp, chat
        self.sent_chars = 0
        self.sent_tokens = 0
        self.prompt_sent = False

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
        if not self.prompt_sent:
            # the prompt's scores are complete before the first token: sent once, first
            self.prompt_sent = True
            choice = _with_prompt_logprobs(choice, out, self.lp)
        self.sent_chars += len(text)
        self.sent_tokens = end
        return choice


def is_error(out: RequestOutput) -> bool:
    return out.finish_reason is FinishReason.ERROR or out.error is not None
