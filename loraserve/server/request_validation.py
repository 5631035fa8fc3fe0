"""What the completion handlers (server/serving.py) check before anything reaches the engine:
the tenant and client a request comes from, n, the prompt's tokens and length, the sampling
parameters within this server's limits, and the structured-output constraint compiled. Every
refusal is an ApiError 400 naming what is wrong; tokenizing and compiling run on executor
threads."""

from __future__ import annotations

from functools import partial

from fastapi import Request

from loraserve.server.context import ServerContext
from loraserve.server.errors import ApiError
from loraserve.types import SamplingParams, StructuredOutput


def tenant_of(request: Request):
    """The tenant whose key sent the request (api_keys.py), or None."""
    return request.scope.get("state", {}).get("tenant")


def client_of(request: Request) -> str | None:
    """The client identity for fairness between clients: the API key's tenant, else the
    connection's address."""
    tenant = tenant_of(request)
    if tenant is not None:
        return tenant.name
    return request.client.host if request.client else None


def check_n(ctx: ServerContext, n: int) -> None:
    if n > ctx.settings.max_n:
        raise ApiError(400, f"n={n} is over this server's limit of {ctx.settings.max_n} "
                            "(--max-n)", "n_too_large")


async def compile_grammar(ctx: ServerContext, spec: StructuredOutput | None):
    """The constraint compiled (or found in the cache) on an executor thread, before the
    request reaches the engine; one that cannot be compiled is a 400 naming why."""
    if spec is None:
        return None
    return await ctx.run_blocking(ctx.aengine.grammars.compile, spec)


async def tokenize(ctx: ServerContext, prompt, tools: list[dict] | None = None) -> list[int]:
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        ids = list(prompt)  # token ids: the engine checks their range
    else:
        fn = ctx.tokenizer.encode if isinstance(prompt, str) else \
            partial(ctx.tokenizer.apply_chat_template, tools=tools)
        try:
            ids = await ctx.run_blocking(fn, prompt)
        except ValueError as e:  # e.g. the chat template rejected the messages
            raise ApiError(400, str(e), "invalid_prompt") from e
    if not ids:
        raise ApiError(400, "the prompt is empty", "empty_prompt")
    limit = ctx.settings.max_prompt_tokens
    if limit is not None and len(ids) > limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's limit is {limit} "
                            "(--max-prompt-tokens)", "prompt_too_long")
    return ids


def sampling_params(ctx: ServerContext, req, max_tokens: int, prompt_len: int,
            logprobs: int | None, structured: StructuredOutput | None) -> SamplingParams:
    limit = ctx.settings.max_tokens_limit
    if max_tokens > limit:
        raise ApiError(400, f"max_tokens={max_tokens} is over this server's limit of {limit} "
                            "(--max-tokens-limit)", "max_tokens_too_large")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, seed=req.seed, stop=req.stops,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            min_tokens=req.min_tokens, min_p=req.min_p, logit_bias=req.logit_bias_pairs,
            structured_outputs=structured)
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_sampling_params") from e
