"""OpenAI-compatible request and response schemas (plus vLLM/SGLang extras).

Every top-level request field is either one of a model's own, a no-op, or refused by name
(server/request_fields.py): an unknown or unimplemented field is never silently ignored.
Validation errors name their field (`param` in the OpenAI error object). Structured outputs
(`response_format`, vLLM's `structured_outputs`) and tools (chat only) are validated here and
compiled by the server.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraserve.server.request_fields import invalid, refuse_unhandled

# str | list[str] | list[int] | list[list[int]]
PromptField = str | list[str] | list[int] | list[list[int]]


class _Request(BaseModel):
    # forbid: the OpenAPI schema says so; refuse_unhandled has already named any extra field
    model_config = ConfigDict(extra="forbid")
    # completion requests: the OpenAI/vLLM lists of unsupported and no-op fields apply
    _sampling: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data):
        if not isinstance(data, dict):
            return data
        # Clients send `"temperature": null` etc. for "unset": use the default instead.
        data = {k: v for k, v in data.items() if v is not None}
        if cls.model_config.get("extra") == "allow":
            return data
        names = {n for f_name, f in cls.model_fields.items() for n in (f_name, f.alias) if n}
        return refuse_unhandled(data, frozenset(names), cls._sampling)


class StreamOptions(_Request):
    include_usage: bool = False
    # OpenAI pads stream chunks with random text when on; the answer is the same without it
    include_obfuscation: bool = False


class _Strict(_Request):
    """A nested object whose every key matters: an unknown key is refused, not ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is required with type "
                             "'json_schema' and only there")
        return self


class StructuredOutputsSpec(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k)]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, "
                             f"grammar, json_object (got {len(given)})")
        return self


class _SamplingFields(_Request):
    _sampling: ClassVar[bool] = True
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI) -> bias
    # vLLM / SGLang extras
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # per prompt token: its logprob and the top k (vLLM); the prompt is computed, not reused
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (vLLM)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsSpec | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 16 or any(not s for s in stops):
            raise invalid("stop", "stop: at most 16 non-empty strings")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, bias):
        for key in bias or {}:
            if not key.strip().isdigit():
                raise invalid("logit_bias", f"logit_bias: keys are token ids, got {key[:40]!r}")
        return bias

    @model_validator(mode="after")
    def _one_output_constraint(self):
        if (self.structured_outputs is not None and self.response_format is not None
                and self.response_format.type != "text"):
            raise invalid("structured_outputs", "response_format and structured_outputs: give "
                                                "one, not both")
        return self

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    max_tokens: int | None = Field(16, ge=0)  # 0: score the prompt only (prompt_logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data):
        if isinstance(data, dict):
            bad = [k for k in ("tools", "tool_choice", "parallel_tool_calls") if k in data]
            if bad:
                raise invalid(bad[0], f"{', '.join(bad)}: only on /v1/chat/completions")
        return data

    @model_validator(mode="after")
    def _checks(self):
        if self.best_of not in (None, 1, self.n):
            raise invalid("best_of", "best_of: only 1 or n is supported")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise invalid("max_tokens", "max_tokens=0 only scores the prompt: set "
                                        "prompt_logprobs, or ask for at least one token")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]  # the empty prompt is rejected later, with a clear message
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class FunctionSpec(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # arguments always follow the schema when a grammar binds


class ToolSpec(_Request):
    type: Literal["function"]
    function: FunctionSpec


class _FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs: logprobs must be true when "
                                          "top_logprobs is set")
        return self

    @model_validator(mode="after")
    def _tool_checks(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise invalid("tools", "tools: two functions have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid("tool_choice", f"tool_choice names {choice.function.name!r}, which "
                                         "is not in tools")
        if choice in ("auto", "required") and not names:
            raise invalid("tool_choice", "tool_choice needs tools")
        constrained = self.structured_outputs is not None or (
            self.response_format is not None and self.response_format.type != "text")
        if constrained and names and self.tool_choice != "none":
            raise invalid("tools", "tools with response_format or structured_outputs: use "
                                   "tool_choice 'none', or drop the output constraint")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class LoadLoraRequest(_Request):
    lora_name: str
    lora_path: str
    pinned: bool = False
    replace: bool = False  # a loaded name gets a new version (name@N); running requests stay
    # the number to give the new version (a deployment of replicas numbers them alike); it
    # must be newer than every earlier version of the name; default: the next one
    version: int | None = Field(None, ge=1)


class UnloadLoraRequest(_Request):
    lora_name: str


# --- responses (plain dicts in OpenAI shape; builders keep the field names in one place) -----


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_response(rid: str, model: str, choices: list[dict], use: dict | None,
                        chunk: bool = False, chat: bool = False) -> dict:
    if chat:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None or not chunk:
        out["usage"] = use
    return out


def model_card(model_id: str, *, root: str, parent: str | None, tier: str, pinned: bool,
               **extra) -> dict:
    return {"id": model_id, "object": "model", "created": int(time.time()),
            "owned_by": "loraserve", "root": root, "parent": parent, "tier": tier,
            "pinned": pinned, **extra}
