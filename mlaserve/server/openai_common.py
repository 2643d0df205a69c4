"""What the OpenAI chat and completions handlers share: the serving context, the model-name and request checks,
finish reasons, usage and log-prob formatting."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlaserve.config import ServerConfig
from mlaserve.core import RequestError, RequestLimits
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.server.manager import GenerateInput, encode_within
from mlaserve.server.protocol import OPENAI_NAMES, APIError, UsageInfo
from mlaserve.server.sse import DONE, sse
from mlaserve.tokenizer import Tokenizer


@dataclass
class ServingContext:
    """Everything a handler needs. `manager` is a TokenizerManager, or a stand-in with the same
    `prepare` / `generate` / `flush_cache` / `get_stats` (tests script model output through one)."""

    manager: Any
    tokenizer: Tokenizer
    server: ServerConfig
    model_name: str
    context_len: int
    max_total_tokens: int | None = None
    model_names: frozenset[str] = frozenset()     # what a request's `model` may say
    created: int = field(default_factory=lambda: int(time.time()))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(ctx: ServingContext, model: str | None) -> None:
    """OpenAI's 404 for a model this server does not serve (no model named is fine)."""
    if model is not None and model not in ctx.model_names:
        raise APIError(f"The model `{model}` does not exist (this server serves `{ctx.model_name}`).", "model", 404,
                       type="invalid_request_error", code="model_not_found")


def prepare(ctx: ServingContext, inputs: list[GenerateInput], prompt_param: str) -> list[GenerateReqMsg]:
    """Every choice checked (the manager's one check) before any runs; errors in OpenAI names."""
    names = {**OPENAI_NAMES, "input_ids": prompt_param}
    try:
        return [ctx.manager.prepare(obj) for obj in inputs]
    except RequestError as e:
        raise e.renamed(names) from None


def encode_prompt(ctx: ServingContext, text: str, param: str, add_bos: bool = True) -> list[int]:
    """`text` tokenized under the manager's limits (`manager.encode_within`), a refusal naming `param`."""
    limits = RequestLimits(ctx.context_len, ctx.max_total_tokens or ctx.context_len, ctx.tokenizer.vocab_size)
    return encode_within(ctx.tokenizer, text, limits, param, add_bos=add_bos,
                         truncate=bool(getattr(ctx.manager, "info", {}).get("allow_auto_truncate")))


async def check_grammars(ctx: ServingContext, reqs: list[GenerateReqMsg]) -> None:
    """The scheduler's check of every structured-output grammar, before anything runs or streams (400 naming the
    field in OpenAI names: `response_format`, `regex`, `ebnf`, `tools`)."""
    try:
        await ctx.manager.check_grammars(reqs)
    except RequestError as e:
        raise e.renamed(OPENAI_NAMES) from None


def finish_reason(meta: dict) -> str | None:
    """OpenAI finish_reason of a snapshot ("stop" / "length"); an aborted request becomes an APIError."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    if fr["type"] == "abort":
        status = fr.get("status_code", 503)
        raise APIError(fr.get("message") or "the request was aborted by the server", None, status)
    return fr["type"]


def stream_end(req: Any, base: dict, finals: list) -> list[str]:
    """The last SSE events of an OpenAI stream: the usage chunk when `stream_options.include_usage`, then [DONE]."""
    events = []
    if req.stream_options is not None and req.stream_options.include_usage:
        events.append(sse({**base, "choices": [], "usage": usage(finals, req.n).model_dump()}))
    return events + [DONE]


def matched_stop(meta: dict) -> Any:
    fr = meta.get("finish_reason") or {}
    return fr.get("matched")


def usage(snapshots: list[dict], n: int) -> UsageInfo:
    """Usage over all choices: each prompt counted once (choices i*n .. i*n+n-1 share prompt i)."""
    metas = [s["meta_info"] for s in snapshots]
    firsts = metas[::n]
    return UsageInfo.of(sum(m["prompt_tokens"] for m in firsts), sum(m["completion_tokens"] for m in metas),
                        sum(m.get("cached_tokens", 0) for m in firsts))


# --- log-probs ------------------------------------------------------------------------------------------
# The manager gives (logprob, token_id) per token and [(logprob, token_id), ...] per position for top-k.

def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tok: Tokenizer, lps: list, tops: list | None) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    def entry(lp: float, tid: int) -> dict:
        text = token_text(tok, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (lp, tid) in enumerate(lps):
        top = tops[i] if tops and i < len(tops) else []
        content.append({**entry(lp, tid), "top_logprobs": [entry(tlp, t) for tlp, t in top or []]})
    return {"content": content}


def completion_logprobs(tok: Tokenizer, lps: list, tops: list | None, offset: int) -> dict:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, (lp, tid) in enumerate(lps):
        text = token_text(tok, tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        top = tops[i] if tops and i < len(tops) else None
        out["top_logprobs"].append({token_text(tok, t): tlp for tlp, t in top} if top else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out
