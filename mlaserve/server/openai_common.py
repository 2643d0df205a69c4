"""What the OpenAI chat and completions handlers share: the serving context, prompt / sampling checks, finish
reasons, usage and log-prob formatting."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlaserve.config import ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.server.protocol import APIError, UsageInfo, error_body
from mlaserve.server.sse import DONE, sse
from mlaserve.tokenizer import Tokenizer

# SamplingParams names -> the API field a user wrote
API_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@dataclass
class ServingContext:
    """Everything a handler needs. `manager` is a TokenizerManager, or a stand-in with the same
    `generate` / `abort` / `flush_cache` / `get_stats` (tests script model output through one)."""

    manager: Any
    tokenizer: Tokenizer
    server: ServerConfig
    model_name: str
    context_len: int
    max_total_tokens: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def max_new_tokens(ctx: ServingContext, n_prompt: int, max_tokens: int | None, prompt_param: str) -> int:
    """Check the prompt against the context; the tokens left for output (all the room when `max_tokens` is None)."""
    if n_prompt >= ctx.context_len:
        raise APIError(f"This model's maximum context length is {ctx.context_len} tokens; the prompt has "
                       f"{n_prompt} tokens (it must leave room for at least one generated token).", prompt_param)
    if ctx.max_total_tokens is not None and n_prompt + 1 > ctx.max_total_tokens:
        raise APIError(f"the prompt has {n_prompt} tokens, more than the KV cache holds ({ctx.max_total_tokens} "
                       "tokens)", prompt_param)
    room = ctx.context_len - n_prompt
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(f"max_tokens={max_tokens} is too large: this model's maximum context length is "
                       f"{ctx.context_len} tokens and the prompt has {n_prompt}, so at most {room} can be "
                       "generated.", "max_tokens")
    return max_tokens


def check_sampling(params: dict[str, Any]) -> None:
    """Raise an APIError naming the field when SamplingParams rejects `params`."""
    try:
        SamplingParams(**params)
    except ValueError as e:
        name = str(e).split("=")[0]
        raise APIError(str(e).replace(name, API_NAMES.get(name, name), 1), API_NAMES.get(name, name)) from None


def finish_reason(meta: dict) -> str | None:
    """OpenAI finish_reason of a snapshot ("stop" / "length"); an aborted request becomes an APIError."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    if fr["type"] == "abort":
        status = fr.get("status_code", 503)
        raise APIError(fr.get("message") or "the request was aborted by the server", None, status)
    return fr["type"]


def stream_error(e: Exception) -> str:
    """The last events of a stream that failed after its headers went out: an OpenAI error body, then [DONE]."""
    status = getattr(e, "status_code", 500)
    param = getattr(e, "param", None)
    return sse(error_body(getattr(e, "message", str(e)), param, status)) + DONE


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
