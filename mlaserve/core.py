"""Core types shared by every level: the forward mode and the per-batch forward context."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:    # NOTE: annotations only: the HTTP process imports this module without torch
    import torch

    from mlaserve.attention.base import BaseAttnBackend
    from mlaserve.kvcache.pool import MLAKVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"   # prefill or chunked extend: new tokens of several requests, any count each
    DECODE = "decode"   # one new token per request (num_q > 1 only for speculative verification)


@dataclass
class ForwardContext:
    """What one model forward needs besides the token ids: where KV goes and which cache rows it reads.

    Legend: `T` new tokens in the batch, `B` requests. Request b's new tokens are the contiguous range
    of T given by `extend_lens_cpu`; they sit at positions prefix_lens_cpu[b] .. seq_lens[b] - 1.

        req_to_token[req_pool_idx[b], 0 : seq_lens[b]]  -> KV-cache slots of request b
        |<-- prefix_lens_cpu[b] (cached) -->|<- extend_lens_cpu[b] (new) ->|
    """

    mode: ForwardMode
    positions: torch.Tensor          # [T] int64
    out_slots: torch.Tensor          # [T] int64: slot each new token's latent KV is written to
    req_pool_idx: torch.Tensor       # [B] int64
    seq_lens: torch.Tensor           # [B] int32 (device), prefix + new
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token: torch.Tensor       # [max_reqs, max_context] int32
    kv_pool: "MLAKVPool"
    attn_backend: "BaseAttnBackend"
    num_q: int = 1                   # query tokens per request in DECODE mode
    logits_indices: torch.Tensor | None = None   # rows of T whose logits are wanted (None: all)
    num_kv_splits: int | None = None     # split-KV count of the decode kernel (fixed under CUDA graphs)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]


class SamplingError(ValueError):
    """A sampling parameter is out of range (the message names the parameter)."""


@dataclass
class SamplingParams:
    """Per-request decoding controls, with SGLang / OpenAI names and defaults."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                  # -1: whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output (CTRL-style)
    frequency_penalty: float = 0.0   # OpenAI: logit -= f * count(token in output)
    presence_penalty: float = 0.0    # OpenAI: logit -= p * (count > 0)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, ">= 0"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "-1 or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2, "in (0, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("min_new_tokens", 0 <= self.min_new_tokens, ">= 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise SamplingError(f"{name}={getattr(self, name)!r} must be {rule}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class RequestSpec:
    """What a submitter asks for (token ids only): the scheduler's `Req` and the IPC message both start here."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False

    def spec_fields(self) -> dict:
        """The `RequestSpec` fields of this object, by name (input_ids copied)."""
        out = {f.name: getattr(self, f.name) for f in fields(RequestSpec)}
        out["input_ids"] = list(self.input_ids)
        return out


@dataclass
class Req(RequestSpec):
    """A request as the scheduler tracks it (text lives in the tokenizer manager).

    KV bookkeeping: req_to_token[req_pool_idx, 0 : kv_len] holds the slots of the first kv_len tokens of
    `fill_ids` (prompt + output so far); the first `prefix_len` of them are owned by the radix cache
    (locked at `last_node`), the rest by the request.
    """

    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_len: int = 0
    last_node: object | None = None
    extend_len: int = 0                    # new tokens in the batch being run
    cached_tokens: int = 0                 # prompt tokens served from the prefix cache (first admission)
    finished: dict | None = None           # {"type": "stop"|"length"|"abort", ...}
    admitted_once: bool = False
    # log-probs gathered so far: (logprob | None, token_id); top: list of (logprob, token_id) per position
    input_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    sent_len: int = 0                      # output tokens already sent to the manager

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def prompt_done(self) -> bool:
        """True once every prompt token has KV (then each step produces a sampled token)."""
        return self.kv_len >= len(self.input_ids)

    @property
    def logprob_start(self) -> int:
        return len(self.input_ids) if self.logprob_start_len < 0 else min(self.logprob_start_len, len(self.input_ids))


@dataclass
class Batch:
    """One forward step as planned by the scheduler. Legend: `T` new tokens, `B` requests.

    Request b contributes extend_lens[b] new tokens (fill_ids[prefix_lens[b] : prefix_lens[b] + extend_lens[b]]),
    laid out back to back in `input_ids`, with KV slots `out_slots`. `sampling[b]`: its last new token
    yields a sampled token (False for a prompt chunk that is not the last).
    """

    mode: ForwardMode
    reqs: list[Req]
    input_ids: list[int]
    out_slots: torch.Tensor          # [T] int64 host slot ids (the runner copies them to the device)
    prefix_lens: list[int]
    extend_lens: list[int]
    sampling: list[bool]

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
