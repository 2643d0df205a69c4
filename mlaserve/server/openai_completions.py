"""`/v1/completions`: text or token-id prompts (one or several), n choices each, `echo` and legacy `logprobs`,
streamed or whole. Choice `p * n + j` is the j-th sample of prompt p."""
from __future__ import annotations

from collections.abc import AsyncIterator

from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.server.manager import GenerateInput
from mlaserve.server.openai_common import (
    ServingContext, check_grammars, completion_logprobs, encode_prompt, finish_reason, matched_stop, new_id, prepare,
    stream_end, usage,
)
from mlaserve.server.protocol import APIError, CompletionRequest
from mlaserve.server.sse import collect, merge, sse


def completion_inputs(req: CompletionRequest, ctx: ServingContext) -> tuple[list[GenerateReqMsg], list[str]]:
    """One checked request per choice (prompt-major), and each prompt's text for `echo`."""
    if req.suffix:
        raise APIError("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported (only best_of == n)", "best_of")
    prompts = req.prompts()
    want_lp = req.logprobs is not None
    inputs = []
    for prompt in prompts:
        ids = encode_prompt(ctx, prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        inputs += [GenerateInput(input_ids=ids, sampling_params=req.sampling_params(req.max_tokens, j),
                                 return_logprob=want_lp, logprob_start_len=0 if req.echo and want_lp else -1,
                                 top_logprobs_num=req.logprobs or 0, stream=req.stream) for j in range(req.n)]
    reqs = prepare(ctx, inputs, "prompt")
    # NOTE: token-id prompts are decoded only once checked (an id outside the vocabulary breaks the decoder)
    texts = [(p if isinstance(p, str) else ctx.tokenizer.decode(p)) if req.echo else "" for p in prompts]
    return reqs, texts


def _logprobs(req: CompletionRequest, ctx: ServingContext, meta: dict, k: int, echo: bool) -> dict | None:
    """Log-probs of output tokens from index k on (and of the prompt first when `echo`)."""
    if req.logprobs is None:
        return None
    lps = list(meta.get("output_token_logprobs", []))[k:]
    tops = list(meta.get("output_top_logprobs") or [None] * (k + len(lps)))[k:]
    if echo:
        in_lps = list(meta.get("input_token_logprobs", []))
        in_tops = list(meta.get("input_top_logprobs") or [])
        in_tops = [None] * (len(in_lps) - len(in_tops)) + in_tops   # the first prompt token has no log-prob
        lps, tops = in_lps + lps, in_tops + tops
    return completion_logprobs(ctx.tokenizer, lps, tops, 0)


async def completion(req: CompletionRequest, ctx: ServingContext) -> dict:
    inputs, prompts = completion_inputs(req, ctx)
    await check_grammars(ctx, inputs)
    snaps = await collect([ctx.manager.generate(obj) for obj in inputs])
    choices = []
    for i, snap in enumerate(snaps):
        meta = snap["meta_info"]
        reason = finish_reason(meta)
        text = prompts[i // req.n] + snap["text"]
        choices.append({"index": i, "text": text, "logprobs": _logprobs(req, ctx, meta, 0, req.echo),
                        "finish_reason": reason, "matched_stop": matched_stop(meta)})
    return {"id": new_id("cmpl"), "object": "text_completion", "created": ctx.created, "model": ctx.model_name,
            "choices": choices, "usage": usage(snaps, req.n).model_dump()}


async def completion_stream(req: CompletionRequest, ctx: ServingContext, inputs: list[GenerateReqMsg],
                            prompts: list[str]) -> AsyncIterator[str]:
    """SSE chunks (the echoed prompt first), usage if asked, [DONE]."""
    n = len(inputs)
    base = {"id": new_id("cmpl"), "object": "text_completion", "created": ctx.created, "model": ctx.model_name}

    def chunk(i: int, text: str, logprobs: dict | None, reason: str | None = None) -> str:
        return sse({**base, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}]})

    sent_text, sent_tokens, finals = [0] * n, [0] * n, [None] * n
    echoed = [not req.echo] * n
    async for i, snap in merge([ctx.manager.generate(obj) for obj in inputs]):
        meta, text = snap["meta_info"], snap["text"]
        reason = finish_reason(meta)
        logprobs = _logprobs(req, ctx, meta, sent_tokens[i], not echoed[i])
        prefix = "" if echoed[i] else prompts[i // req.n]
        delta = prefix + text[sent_text[i]:]
        echoed[i], sent_text[i] = True, len(text)
        sent_tokens[i] = len(meta.get("output_token_logprobs", []))
        if delta or reason is not None or (logprobs and logprobs["tokens"]):
            yield chunk(i, delta, logprobs, reason)
        if reason is not None:
            finals[i] = snap
    for event in stream_end(req, base, finals):
        yield event
