"""Which top-level request fields a body may carry beyond its model's own.

A field this server does not know, or knows but does not implement, is refused with a 400
naming it: ignoring it would hand back an answer the client did not ask for (a `tools` or
`structured_outputs` request answered with unconstrained text). Only fields that cannot change
the answer are accepted without effect, and a field set to null counts as unset (SDKs send
nulls for every field they know).
"""

from __future__ import annotations

from pydantic_core import PydanticCustomError

# Fields of the OpenAI / vLLM / SGLang schemas that would change the answer and that loraserve
# does not implement: refused by name unless set to their no-op value.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "functions": ([],), "function_call": ("none",), "length_penalty": (1, 1.0),
    "echo": (False,), "suffix": ("",),
    "use_beam_search": (False,), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "json_schema": (), "regex": (), "ebnf": (), "bad_words": ([],),
    "guided_decoding_backend": (),
    "allowed_token_ids": (), "truncate_prompt_tokens": (),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,), "prediction": (), "audio": (),
    "modalities": (["text"],), "reasoning_effort": (), "web_search_options": (),
    "verbosity": ("medium",), "store": (False,), "service_tier": ("auto", "default"),
}

# OpenAI fields that only label or route a request and cannot change its answer. (A
# client's cache key is never used as one: the prefix cache keys by the weights' content.)
NO_OP_FIELDS = frozenset({"metadata", "safety_identifier", "prompt_cache_key"})


def invalid(param: str | None, message: str) -> PydanticCustomError:
    """A validation error with its own message (no "Value error, " prefix) that names the
    offending field; errors.py puts `param` into the OpenAI error object."""
    return PydanticCustomError("invalid_request", message, {"param": param})


def refuse_unhandled(data: dict, known: frozenset[str], sampling: bool) -> dict:
    """`data` without the accepted no-op fields; raises naming every field it cannot honour.
    `sampling`: the body is a completion request, so the OpenAI/vLLM field lists apply."""
    unsupported = [k for k in data if sampling and k in UNSUPPORTED_FIELDS
                   and data[k] not in UNSUPPORTED_FIELDS[k]]
    tolerated = (UNSUPPORTED_FIELDS.keys() | NO_OP_FIELDS) if sampling else frozenset()
    unknown = [k for k in data if k not in known and k not in tolerated]
    problems = []
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        problems.append(f"unknown field{plural} {', '.join(unknown)}: not part of this "
                        "server's API")
    if unsupported:
        problems.append(f"{', '.join(unsupported)}: not supported by this server")
    if problems:
        raise invalid((unknown or unsupported)[0],
                      "; ".join(problems) + " (refused rather than ignored)")
    return {k: v for k, v in data.items() if k in known}
