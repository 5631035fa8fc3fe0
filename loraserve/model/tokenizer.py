"""Tokenizer wrapper, streaming detokenizer and stop-string matching.

Every decode goes through `Tokenizer.decode`, so streamed text and a one-shot decode of the same
ids agree (no tokenization-space cleanup anywhere: it corrupts BPE output).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from loraserve.model.tools import ToolFormat, detect_tool_format
from loraserve.model.tools.base import arguments_object

REPLACEMENT = "\ufffd"  # what a decode yields for an incomplete UTF-8 sequence


class Tokenizer:
    """A local Hugging Face tokenizer (`AutoTokenizer`, never downloads) plus the ids the engine
    needs: eos ids from the tokenizer and generation_config.json (chat models list several)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self.eos_token_ids: set[int] = _eos_ids(self.path, self.hf.eos_token_id)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a raw prompt. Special tokens are added only where the tokenizer's own
        post-processor says so (e.g. Llama's BOS); SmolLM2 and ChatML models add none."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @cached_property
    def tool_format(self) -> ToolFormat:
        """The tool-call syntax of this model's family (model/tools/)."""
        return detect_tool_format(self.hf.chat_template, self.hf.get_vocab())

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template applied to `messages` (and `tools`, OpenAI's shape), ending with
        the assistant prompt. Templates that render no tools get them written into the
        messages in the family's format (model/tools/)."""
        if not self.has_chat_template:
            raise ValueError(f"the model at {self.path} has no chat template; use completions")
        from jinja2 import TemplateError

        fmt = self.tool_format
        kwargs = {}
        if fmt.native:
            messages = [_native_tool_calls(m) for m in messages]
            if tools:
                kwargs["tools"] = tools
        else:
            messages = fmt.render_messages(messages, tools or [])
        try:
            return self.hf.apply_chat_template(
                [_normalize_message(m) for m in messages],
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
        except TemplateError as e:  # e.g. "roles must alternate": the client's fault
            raise ValueError(f"chat template rejected the messages: {e}") from e

    def apply_chat_template(self, messages: list[dict],
                            tools: list[dict] | None = None) -> list[int]:
        # The template already writes any BOS it wants, so add no special tokens again.
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)



def _normalize_message(message: dict) -> dict:
    """OpenAI allows content as a list of parts; templates expect a string."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        if any(p.get("type", "text") != "text" for p in content if isinstance(p, dict)):
            raise ValueError("only text content parts are supported")
        message = {**message, "content": "".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    return message


def _native_tool_calls(message: dict) -> dict:
    """Templates read a call's arguments as an object; OpenAI sends them as JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = [{**c, "function": {**c.get("function", {}), "arguments": arguments_object(c)}}
             for c in calls]
    return {**message, "tool_calls": fixed}


def _eos_ids(path: Path, tokenizer_eos: int | None) -> set[int]:
    ids = set() if tokenizer_eos is None else {int(tokenizer_eos)}
    # generation_config.json is what HF generate() stops on; config.json is its fallback.
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        eos = json.loads(file.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        break
    return ids


class IncrementalDetokenizer:
    """Turns output token ids, fed one at a time, into text deltas for streaming.

    Prefix-offset method (vLLM's detokenize_incrementally, HF TextStreamer): decode only a short
    window `ids[prefix:]` and emit what it adds beyond `ids[prefix:read]`, so each step costs a
    few tokens, not the whole output. Decoding the window from a token boundary that is also a
    character boundary keeps SentencePiece's leading-space handling and byte-level BPE exact.
    A delta never ends in a partial UTF-8 character: text ending in U+FFFD is held back. After
    MAX_HOLD held tokens (junk bytes), the part before the trailing U+FFFD run is emitted anyway.
    Invariant: the concatenated deltas plus `flush()` equal `tokenizer.decode(output_ids)`
    (with prompt context: the output's text as it reads after the prompt).
    """

    CONTEXT = 5  # prompt tokens decoded as context, as vLLM does
    MAX_HOLD = 4  # a UTF-8 char has at most 4 bytes; each token carries at least one

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        ctx = list(prompt_ids[-self.CONTEXT :]) if prompt_ids else []
        # A prompt ending mid-character would make the first delta misaligned; drop it.
        if ctx and self._decode(ctx).endswith(REPLACEMENT):
            ctx = []
        self._ids: list[int] = ctx
        self._prefix = 0
        self._read = len(ctx)
        self._prefix_text = self._decode(ctx) if ctx else ""
        self._sent = 0  # chars past prefix_text already emitted while held (junk bytes)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _advance(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        self._sent = 0

    def add(self, token_id: int) -> str:
        """Feed one token id; returns the new text (possibly empty)."""
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids[self._prefix :])
        start = len(self._prefix_text) + self._sent
        if new_text.endswith(REPLACEMENT):
            if len(self._ids) - self._read < self.MAX_HOLD:
                return ""
            delta = new_text[start : len(new_text.rstrip(REPLACEMENT))]
            self._sent += len(delta)
        else:
            delta = new_text[start:]
            # A skipped special token adds no text; keep it in the window (vLLM does too).
            if len(new_text) > len(self._prefix_text):
                self._advance()
        self.text += delta
        return delta

    def add_many(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back, U+FFFD included."""
        new_text = self._decode(self._ids[self._prefix :])
        delta = new_text[len(self._prefix_text) + self._sent :]
        self._advance()
        self.text += delta
        return delta


class StopChecker:
    """Finds stop strings in generated text and says how much of its end to withhold.

    OpenAI semantics: the output ends just before the earliest stop string, which is not
    included. While streaming, a tail that could still grow into a stop string must be withheld.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.floor = 0  # matches start at or after this index (text before it is protected)

    def __bool__(self) -> bool:
        return bool(self.stop)

    def find(self, text: str, new_chars: int | None = None) -> int | None:
        """Index where the earliest stop string starts in `text`, or None.

        `new_chars`: only the last `new_chars` characters are new and the rest was checked
        before, so a match must end in them; the search starts max_len - 1 chars earlier.
        """
        if not self.stop:
            return None
        start = 0 if new_chars is None else max(0, len(text) - new_chars - self.max_len + 1)
        start = max(start, self.floor)
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def holdback(self, text: str) -> int:
        """Number of trailing chars of `text` that are a proper prefix of some stop string."""
        for n in range(min(self.max_len - 1, len(text) - self.floor), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
