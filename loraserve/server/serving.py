"""/v1/completions and /v1/chat/completions: validate (server/request_validation.py), fan out,
stream or collect.

Every sequence a request fans out to (prompts x n) is admitted all-or-nothing before any
response starts, so admission errors are a 4xx and never half an SSE stream. Whatever way a
handler ends (done, client gone, error), every stream is aborted in `finally`: the engine gives
back KV blocks and adapter refcounts at once (aborting a finished request is a no-op).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraserve.adapters.versions import label, split_model
from loraserve.engine.request_stream import RequestStream
from loraserve.server import protocol as P
from loraserve.server.context import ServerContext, parse_body
from loraserve.server.errors import ApiError, error_body, retry_headers
from loraserve.server.formatting import DeltaTracker, LogprobFormatter, full_choice, is_error, sse
from loraserve.server.metrics import RequestTimer
from loraserve.server.quotas import record_usage
from loraserve.server.request_validation import (
    check_n,
    client_of,
    compile_grammar,
    sampling_params,
    tenant_of,
    tokenize,
)
from loraserve.server.structured import structured_output_of
from loraserve.server.tool_calls import ToolDeltaTracker, ToolPlan, tool_choice_message, tool_plan
from loraserve.types import SEED_RANGE, AdapterNotFoundError, SamplingParams


async def completions(ctx: ServerContext, request: Request) -> Response:
    ctx.check_accepting()
    req = await parse_body(request, P.CompletionRequest)
    lora = ctx.resolve_model(req.model, tenant_of(request))
    prompts = req.prompts()
    if len(prompts) > ctx.settings.max_prompts:
        raise ApiError(400, f"{len(prompts)} prompts in one request; the limit is "
                            f"{ctx.settings.max_prompts}", "too_many_prompts")
    check_n(ctx, req.n)
    ids = [await tokenize(ctx, p) for p in prompts]
    spec = structured_output_of(req)
    grammar = await compile_grammar(ctx, spec)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    params = sampling_params(ctx, req, max_tokens, max(map(len, ids)), req.logprobs, spec)
    return await _serve(ctx, request, req, ids, params, lora, chat=False, grammar=grammar)


async def chat_completions(ctx: ServerContext, request: Request) -> Response:
    ctx.check_accepting()
    req = await parse_body(request, P.ChatCompletionRequest)
    lora = ctx.resolve_model(req.model, tenant_of(request))
    check_n(ctx, req.n)
    plan = tool_plan(req, ctx.tokenizer.tool_format)
    tools = plan and [t.model_dump(exclude_none=True) for t in req.tools]
    ids = await tokenize(ctx, req.message_dicts(), tools)
    spec = structured_output_of(req) or (plan and plan.constraint())
    grammar = await compile_grammar(ctx, spec)
    max_tokens = req.max_new_tokens
    if max_tokens is None:  # the room left in the context, within the server's cap
        info = ctx.aengine.info
        room = min(info.max_model_len, info.kv_capacity_tokens) - len(ids)
        max_tokens = max(1, min(ctx.settings.max_tokens_limit, room))
    params = sampling_params(ctx, req, max_tokens, len(ids), req.num_logprobs, spec)
    return await _serve(ctx, request, req, [ids], params, lora, chat=True, grammar=grammar,
                        plan=plan)


# --- admission, then stream or collect --------------------------------------------------------


def _nth_seed(seed: int, j: int) -> int:
    """Seed of choice j: seed + j, wrapped within the seeds a generator accepts."""
    lo, hi = SEED_RANGE
    return (seed + j - lo) % (hi - lo + 1) + lo


async def _submit(ctx: ServerContext, req, ids: list[list[int]], params: SamplingParams,
                  lora: str | None, client_id: str | None, grammar=None) -> list[RequestStream]:
    """Admit prompts x n sequences, all or none. Choice index = prompt * n + j. Every
    sequence runs on one adapter version: if a replace lands between their admissions, they
    are all admitted again on the first one's version (name@N)."""
    streams = await _admit_all(ctx, req, ids, params, lora, client_id, grammar)
    versions = {s.adapter_version for s in streams}
    if lora is not None and len(versions) > 1:
        for s in streams:
            s.abort()
        pinned = label(split_model(lora)[0], streams[0].adapter_version)
        streams = await _admit_all(ctx, req, ids, params, pinned, client_id, grammar)
    return streams


async def _admit_all(ctx: ServerContext, req, ids: list[list[int]], params: SamplingParams,
                     lora: str | None, client_id: str | None, grammar) -> list[RequestStream]:
    base_id = P.new_id("cmpl")
    jobs = []
    for i, prompt in enumerate(ids):
        for j in range(req.n):
            # Distinct seeds per choice: n identical samples would be useless.
            sp = params if params.seed is None else replace(params, seed=_nth_seed(params.seed, j))
            # choice 0 computes the prompt; the others fork from its K/V (copy-on-write)
            jobs.append(ctx.aengine.add_request(prompt, sp, lora, f"{base_id}-{i}-{j}",
                                                origin=base_id,
                                                fork_of=f"{base_id}-{i}-0" if j else None,
                                                client_id=client_id, grammar=grammar))
    results = await asyncio.gather(*jobs, return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    errors = [r for r in results if not isinstance(r, RequestStream)]
    if errors:
        for s in streams:
            s.abort()
        if isinstance(errors[0], AdapterNotFoundError):
            raise ctx.model_not_found(req.model) from errors[0]
        raise errors[0]
    return streams


async def _serve(ctx: ServerContext, request: Request, req, ids, params, lora, chat: bool,
                 grammar=None, plan: ToolPlan | None = None):
    streams = await _submit(ctx, req, ids, params, lora, client_of(request), grammar)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    model = req.model or ctx.model_name
    if lora is not None:  # the version the answer comes from
        lora = split_model(lora)[0]
        model = label(lora, streams[0].adapter_version)
    prompt_tokens = sum(map(len, ids))
    timers = [RequestTimer(ctx.metrics, lora) for _ in streams]
    lp = LogprobFormatter(ctx.tokenizer, req.return_tokens_as_token_ids)
    if req.stream:
        gen = _stream(streams, timers, lp, rid, model, chat, req.include_usage, prompt_tokens,
                      req.n, request.scope, plan)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    try:
        outs = await _collect(ctx, request, streams, timers)
    finally:  # what the tenant used, for its tokens_per_minute (quotas.py)
        record_usage(request.scope, prompt_tokens + sum(t.n for t in timers))
    if outs is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    for out in outs:
        if is_error(out):
            status, body = _error_of(out)
            return JSONResponse(body, status_code=status, headers=retry_headers(status))
    choices = [full_choice(i, out, lp, chat) for i, out in enumerate(outs)]
    if plan is not None:
        choices = [tool_choice_message(plan, c, out) for c, out in zip(choices, outs, strict=True)]
    completion = sum(len(o.token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs[::req.n])  # each prompt once, as counted
    return JSONResponse(P.completion_response(rid, model, choices,
                                              P.usage(prompt_tokens, completion, cached),
                                              chat=chat))


async def _collect(ctx: ServerContext, request: Request, streams, timers):
    """Last output of every stream, or None if the client went away first. Starlette cancels
    only streaming responses on disconnect, so poll for it here."""

    async def last(stream: RequestStream, timer: RequestTimer):
        out = None
        async for out in stream:
            timer.on_output(out)
        return out

    task = asyncio.ensure_future(asyncio.gather(*map(last, streams, timers)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=ctx.settings.disconnect_poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)  # no "exception was never retrieved" noise
        for s in streams:
            s.abort()


def _error_of(out) -> tuple[int, dict]:
    """An ended-with-error output as (HTTP status, OpenAI error body): a 4xx when the adapter
    the client named cannot be served, a 500 only for our own bugs."""
    status = out.error_status or 500
    code = ("adapter_load_failed" if 400 <= status < 500 else
            "server_unavailable" if status == 503 else "engine_error")
    return status, error_body(status, out.error or "request failed", code)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def _merge(streams: list[RequestStream]):
    """(index, output) from all streams as they arrive."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()


async def _stream(streams, timers, lp, rid, model, chat, include_usage, prompt_tokens, n,
                  scope, plan: ToolPlan | None = None):
    trackers = [DeltaTracker(i, lp, chat) if plan is None else ToolDeltaTracker(i, lp, plan)
                for i in range(len(streams))]
    completion = cached = 0

    def chunk(choices, use=None):
        return sse(P.completion_response(rid, model, choices, use, chunk=True, chat=chat))

    try:
        if chat:  # the role comes first, once per choice, as OpenAI sends it
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
                         for i in range(len(streams))])
        async for i, out in _merge(streams):
            timers[i].on_output(out)
            if is_error(out):
                yield sse(_error_of(out)[1])
                break
            choice = trackers[i].delta(out)
            if choice is not None:
                yield chunk([choice])
            if out.finished:
                completion += len(out.token_ids)
                cached += out.num_cached_tokens if i % n == 0 else 0
        else:
            if include_usage:
                yield chunk([], P.usage(prompt_tokens, completion, cached))
        record_usage(scope, prompt_tokens + sum(t.n for t in timers))  # charged before [DONE]
        yield sse("[DONE]")
    finally:  # client gone (cancelled) or done: free every sequence's blocks now
        for s in streams:
            s.abort()
        record_usage(scope, prompt_tokens + sum(t.n for t in timers))
