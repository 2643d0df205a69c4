"""`/v1/completions`: text or token-id prompts (one or several), n choices each, `echo` and legacy `logprobs`,
streamed or whole. Choice `p * n + j` is the j-th sample of prompt p."""
from __future__ import annotations

from collections.abc import AsyncIterator

from mlaserve.server.manager import GenerateInput, RequestError
from mlaserve.server.openai_common import (
    ServingContext, check_sampling, completion_logprobs, finish_reason, matched_stop, max_new_tokens, new_id,
    stream_end, stream_error, usage,
)
from mlaserve.server.protocol import APIError, CompletionRequest
from mlaserve.server.sse import collect, merge, sse


class Prompt:
    """One prompt: its ids and the text `echo` returns."""

    def __init__(self, ctx: ServingContext, prompt: str | list[int]):
        if isinstance(prompt, str):
            self.ids, self.text = ctx.tokenizer.encode(prompt), prompt
        else:
            self.ids, self.text = list(prompt), ctx.tokenizer.decode(prompt)


def completion_inputs(req: CompletionRequest, ctx: ServingContext) -> tuple[list[GenerateInput], list[Prompt]]:
    """One GenerateInput per choice (prompt-major), and the prompts."""
    if req.suffix:
        raise APIError("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported (only best_of == n)", "best_of")
    prompts = [Prompt(ctx, p) for p in req.prompts()]
    want_lp = req.logprobs is not None
    inputs = []
    for prompt in prompts:
        if any(not 0 <= t < ctx.tokenizer.vocab_size for t in prompt.ids):
            raise APIError(f"token ids in prompt must be in [0, {ctx.tokenizer.vocab_size})", "prompt")
        max_new = max_new_tokens(ctx, len(prompt.ids), req.max_tokens, "prompt")
        for j in range(req.n):
            params = req.sampling_params(max_new, j)
            check_sampling(params)
            inputs.append(GenerateInput(input_ids=prompt.ids, sampling_params=params, return_logprob=want_lp,
                                        logprob_start_len=0 if req.echo and want_lp else -1,
                                        top_logprobs_num=req.logprobs or 0, stream=req.stream))
    return inputs, prompts


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
    snaps = await collect([ctx.manager.generate(obj) for obj in inputs])
    choices = []
    for i, snap in enumerate(snaps):
        meta = snap["meta_info"]
        reason = finish_reason(meta)
        text = (prompts[i // req.n].text if req.echo else "") + snap["text"]
        choices.append({"index": i, "text": text, "logprobs": _logprobs(req, ctx, meta, 0, req.echo),
                        "finish_reason": reason, "matched_stop": matched_stop(meta)})
    return {"id": new_id("cmpl"), "object": "text_completion", "created": ctx.created, "model": ctx.model_name,
            "choices": choices, "usage": usage(snaps, req.n).model_dump()}


async def completion_stream(req: CompletionRequest, ctx: ServingContext, inputs: list[GenerateInput],
                            prompts: list[Prompt]) -> AsyncIterator[str]:
    """SSE chunks (the echoed prompt first), usage if asked, [DONE]."""
    n = len(inputs)
    base = {"id": new_id("cmpl"), "object": "text_completion", "created": ctx.created, "model": ctx.model_name}

    def chunk(i: int, text: str, logprobs: dict | None, reason: str | None = None) -> str:
        return sse({**base, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}]})

    sent_text, sent_tokens, finals = [0] * n, [0] * n, [None] * n
    echoed = [not req.echo] * n
    try:
        async for i, snap in merge([ctx.manager.generate(obj) for obj in inputs]):
            meta, text = snap["meta_info"], snap["text"]
            reason = finish_reason(meta)
            logprobs = _logprobs(req, ctx, meta, sent_tokens[i], not echoed[i])
            prefix = "" if echoed[i] else prompts[i // req.n].text
            delta = prefix + text[sent_text[i]:]
            echoed[i], sent_text[i] = True, len(text)
            sent_tokens[i] = len(meta.get("output_token_logprobs", []))
            if delta or reason is not None or (logprobs and logprobs["tokens"]):
                yield chunk(i, delta, logprobs, reason)
            if reason is not None:
                finals[i] = snap
    except (APIError, RequestError) as e:
        yield stream_error(e)
        return
    for event in stream_end(req, base, finals):
        yield event
