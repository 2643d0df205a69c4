"""Core types shared by every level: the forward mode and context, the sampling parameters, requests and batches."""
from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationInfo,
    field_validator,
)

if TYPE_CHECKING:    # NOTE: annotations only: the HTTP process imports this module without torch
    import torch

    from mlaserve.attention.base import BaseAttnBackend
    from mlaserve.kvcache.pool import MLAKVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"   # prefill or chunked extend: new tokens of several requests, any count each
    DECODE = "decode"   # one new token per request (num_q > 1 only for speculative verification)
    IDLE = "idle"       # no tokens: this DP-attention group takes part in the other groups' MoE collectives


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
    seq_lens: torch.Tensor           # [B] int32 or int64 (device), prefix + new
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token: torch.Tensor       # [max_reqs, max_context] int32
    kv_pool: "MLAKVPool"
    attn_backend: "BaseAttnBackend"
    num_q: int = 1                   # query tokens per request in DECODE mode
    logits_indices: torch.Tensor | None = None   # rows of T whose logits are wanted (None: all)
    num_kv_splits: int | None = None     # split-KV count of the decode kernel (fixed under CUDA graphs)
    # the decode may run its attention chain as one launch (kernels/mla_chain.py): set by the decode graphs' short-
    # context bs-1 graph only (engine/graph.py), whose split count is sized for the contexts it replays
    chain: bool = False
    global_num_tokens: list[int] | None = None   # DP attention: tokens of each DP group this step (agreed)
    # decode graphs: [D * P] bool (D DP groups, else 1), the MoE's rows (gathered under DP attention) that are a
    # request's; the others, padding, route to no expert. None: every row routes
    moe_row_mask: torch.Tensor | None = None
    # EXTEND mode: the last num_decode requests are decodes of a mixed batch, one token each (under speculative
    # decoding the nodes of the step's verify each)
    num_decode: int = 0
    parts: "tuple[ForwardContext, ForwardContext] | None" = None   # a mixed batch's `split_mixed()`, made once
    tree_mask: torch.Tensor | None = None    # [T] int64, DECODE: bit i = sees new token i of its request (None: causal)
    # EXTEND under piecewise CUDA graphs (engine/piecewise.py): called as splitter(attn, q, kv_c, k_pe, kv_new) in
    # place of attn.attend_extend, it runs the attention between two captured pieces and returns its output [T, H, Dv]
    splitter: "Callable | None" = None
    # what the attention backend derives from this batch once and every layer reuses (e.g. its prefix slots)
    attn_cache: dict = field(default_factory=dict)
    input_ids: torch.Tensor | None = None    # [T] int64 on the device, where `build_context` uploaded them

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_tokens(self) -> int:
        """EXTEND mode: the tokens of a mixed batch's decodes (its last rows)."""
        return sum(self.extend_lens_cpu[self.batch_size - self.num_decode:]) if self.num_decode else 0

    def split_mixed(self) -> tuple[ForwardContext, ForwardContext]:
        """A mixed batch (EXTEND, num_decode = n > 0) as (its extends, EXTEND; its decodes, DECODE), so attention
        runs the non-absorbed form on the first and the absorbed one on the second:

            requests  | 0 .. B - n - 1: prompts, prompt chunks | B - n .. B - 1: decodes, q tokens each   |
            tokens    | 0 .. T - n q - 1                       | T - n q .. T - 1 (causal within each q)  |

        q is 1, or under speculative decoding the step's verified tokens (the last token and its drafts)."""
        n, b = self.num_decode, self.batch_size - self.num_decode
        q = self.extend_lens_cpu[b] if n else 1
        assert self.mode is ForwardMode.EXTEND and n > 0 and self.extend_lens_cpu[b:] == [q] * n, \
            "a mixed batch ends with its decodes, the same number of tokens each"
        t = n * q
        common = dict(logits_indices=None, num_decode=0, parts=None, attn_cache={}, input_ids=None)
        ext = replace(self, positions=self.positions[:-t], out_slots=self.out_slots[:-t],
                      req_pool_idx=self.req_pool_idx[:b], seq_lens=self.seq_lens[:b],
                      seq_lens_cpu=self.seq_lens_cpu[:b], extend_lens_cpu=self.extend_lens_cpu[:b], **common)
        dec = replace(self, mode=ForwardMode.DECODE, positions=self.positions[-t:], out_slots=self.out_slots[-t:],
                      req_pool_idx=self.req_pool_idx[b:], seq_lens=self.seq_lens[b:],
                      seq_lens_cpu=self.seq_lens_cpu[b:], extend_lens_cpu=[q] * n, num_q=q, **common)
        return ext, dec

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]


# --- functions torch.compile must not trace (Triton launchers, collectives, host syncs) ------------------------

# each entry: [what the wrapper calls, the plain function]; the state of make_compile_opaque()
_COMPILE_OPAQUE: list[list[Callable]] = []
_compile_opaque_on = False


def compile_opaque(fn: Callable) -> Callable:
    """`fn` behind a wrapper that torch.compile does not trace into once `make_compile_opaque()` has run (the
    runners call it before their first compile); until then the wrapper calls `fn` itself. Functions and methods.

    NOTE: `torch.compiler.disable` imports dynamo, about 1.3 s of each process's start on a CPU (every rank of
    every Engine), so it is applied only in the processes that compile."""
    box = [fn, fn]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return box[0](*args, **kwargs)

    _COMPILE_OPAQUE.append(box)
    if _compile_opaque_on:
        import torch

        box[0] = torch.compiler.disable(fn)
    return call


def make_compile_opaque() -> None:
    """Every `compile_opaque` function, made and made later, from now on through `torch.compiler.disable`."""
    global _compile_opaque_on
    if _compile_opaque_on:                    # every runner that compiles calls this
        return
    import torch

    _compile_opaque_on = True
    for box in _COMPILE_OPAQUE:
        box[0] = torch.compiler.disable(box[1])


# --- the sampling parameters: one typed declaration for the Engine API, /generate and the OpenAI routes ---------

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_utf8(text: str) -> str:
    """`text` itself, or ValueError when it cannot be encoded as UTF-8."""
    # NOTE: JSON may carry a lone surrogate (U+D800 .. U+DFFF); it cannot be tokenized or sent back as UTF-8
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text contains a lone surrogate (not valid UTF-8)") from None
    return text


def _top_k(k: int) -> int:
    if k == 0:
        raise ValueError("top_k must be -1 (off) or >= 1")
    return k


def _token_keys(bias: dict[int | str, float]) -> dict[int, float]:
    return {int(k): v for k, v in bias.items()}


# Field types, shared with the OpenAI request schemas (server/protocol.py) so every route has the same rules.
# Strict: a string is never a number, a bool never an int; floats are finite.
Text = Annotated[StrictStr, AfterValidator(check_utf8)]
Real = Annotated[StrictFloat, Field(allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
MaxNewTokens = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
Temperature = Annotated[Real, Field(ge=0, le=2)]
TopP = Annotated[Real, Field(gt=0, le=1)]
TopK = Annotated[StrictInt, Field(ge=-1, le=INT32_MAX), AfterValidator(_top_k)]
MinP = Annotated[Real, Field(ge=0, le=1)]
RepetitionPenalty = Annotated[Real, Field(gt=0, le=2)]
Penalty = Annotated[Real, Field(ge=-2, le=2)]
Seed = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
Stop = Text | list[Text]
# OpenAI logit_bias: {"token id": bias}; JSON keys are strings, the Engine API may use ints
LogitBias = Annotated[dict[TokenId | Annotated[StrictStr, Field(pattern=r"^[0-9]{1,9}$")],
                           Annotated[Real, Field(ge=-100, le=100)]], AfterValidator(_token_keys)]


GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")   # SGLang's names of the constraints


class SamplingParams(BaseModel):
    """Per-request decoding controls, with SGLang names and defaults (OpenAI names are mapped onto these).

    The one declaration of their types and ranges: a wrong value raises pydantic's ValidationError naming the
    field. `max_new_tokens=None` means as many as fit (`check_request` resolves it); 0 scores the prompt only.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    max_new_tokens: MaxNewTokens | None = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1                          # -1: whole vocabulary
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0   # > 1 discourages tokens already in prompt or output (CTRL)
    frequency_penalty: Penalty = 0.0          # OpenAI: logit -= f * count(token in output)
    presence_penalty: Penalty = 0.0           # OpenAI: logit -= p * (count > 0)
    stop: Stop | None = None                  # a string is one stop string
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    min_new_tokens: MaxNewTokens = 0
    seed: Seed | None = None                  # None: the server draws one (from --seed's RNG)
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    logit_bias: LogitBias | None = None       # token id -> added to its logit (OpenAI: -100 .. 100)
    # structured output (at most one): the output must match it (--grammar-backend)
    json_schema: Text | None = None           # a JSON schema, as JSON text
    regex: Text | None = None                 # a regular expression the whole output matches
    ebnf: Text | None = None                  # a grammar in (xgrammar's) EBNF, start rule `root`
    structural_tag: Text | None = None        # an xgrammar structural tag, as JSON text

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        return [v] if isinstance(v, str) else v

    @field_validator("min_new_tokens")
    @classmethod
    def _min_le_max(cls, v: int, info: ValidationInfo) -> int:
        most = info.data.get("max_new_tokens")
        if most is not None and v > most:
            raise ValueError(f"min_new_tokens ({v}) must not exceed max_new_tokens ({most})")
        return v

    @field_validator(*GRAMMAR_KINDS)
    @classmethod
    def _one_grammar(cls, v: str | None, info: ValidationInfo) -> str | None:
        other = next((k for k in GRAMMAR_KINDS if info.data.get(k) is not None), None)
        if v is not None and other is not None:
            raise ValueError(f"give at most one of {', '.join(GRAMMAR_KINDS)} (also got {other})")
        return v

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, or None."""
        kind = next((k for k in GRAMMAR_KINDS if getattr(self, k) is not None), None)
        return None if kind is None else (kind, getattr(self, kind))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_sampler(self) -> bool:
        """True when the plain argmax is not enough (sampling, penalties or a logit bias)."""
        return (not self.is_greedy or self.repetition_penalty != 1 or bool(self.frequency_penalty)
                or bool(self.presence_penalty) or bool(self.logit_bias))


# --- checking a tokenized request, and how a request ends ------------------------------------------------

class RequestError(ValueError):
    """A request the engine refuses: the message is for the user, `param` names the field, 4xx status."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400):
        super().__init__(message)
        self.message, self.param, self.status_code = message, param, status_code

    def renamed(self, names: dict[str, str]) -> RequestError:
        """The same error with `param` (and its mention in the message) in an API's own names."""
        if self.param not in names:
            return self
        # every name the message mentions (e.g. "min_new_tokens (20) must not exceed max_new_tokens (16)")
        message = re.sub(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?!\w)",
                         lambda mt: names[mt.group(1)], self.message)
        return RequestError(message, names[self.param], self.status_code)


@dataclass(frozen=True)
class RequestLimits:
    context_len: int          # prompt + output tokens per request
    max_total_tokens: int     # KV-pool size in tokens
    vocab_size: int


def check_request(ids: list[int], params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """The one check of a tokenized request against the model and the KV pool.

    Returns `params` with max_new_tokens resolved: None or the default becomes at most what fits; an
    explicit value that cannot fit (context or KV pool, so a lone request never outgrows the pool) is
    refused. Raises RequestError naming `input_ids`, `max_new_tokens` or `logit_bias`.
    """
    n, vocab = len(ids), limits.vocab_size
    if n == 0:
        raise RequestError("the prompt is empty", "input_ids")
    if min(ids) < 0 or max(ids) >= vocab:
        raise RequestError(f"token ids must be in [0, {vocab})", "input_ids")
    if n >= limits.context_len:
        raise RequestError(f"This model's maximum context length is {limits.context_len} tokens; the prompt has "
                           f"{n} tokens (it must leave room for at least one generated token).", "input_ids")
    if n >= limits.max_total_tokens:
        raise RequestError(f"the prompt has {n} tokens, more than the KV cache holds ({limits.max_total_tokens} "
                           "tokens, one of them for a generated token)", "input_ids")
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise RequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    want, room = params.max_new_tokens, min(limits.context_len, limits.max_total_tokens) - n
    if want is not None and want > room and "max_new_tokens" in params.model_fields_set:
        held = ("this model's maximum context length is", limits.context_len)
        if limits.max_total_tokens < limits.context_len:
            held = ("the KV cache holds", limits.max_total_tokens)
        raise RequestError(f"max_new_tokens={want} is too large: {held[0]} {held[1]} tokens and the prompt has "
                           f"{n}, so at most {room} can be generated.", "max_new_tokens")
    if params.min_new_tokens > room:                 # (max_new_tokens unset: it would become `room`)
        raise RequestError(f"min_new_tokens={params.min_new_tokens} cannot be met: the prompt has {n} tokens, so at "
                           f"most {room} can be generated.", "min_new_tokens")
    if want is None or want > room:
        return params.model_copy(update={"max_new_tokens": room})
    return params


def check_text_length(min_tokens: int, limits: RequestLimits) -> None:
    """Refuse a prompt text whose token count is surely too large from a lower bound of it (`min_tokens`), before
    tokenizing it: a prompt of megabytes ties up the server's event loop for seconds to minutes."""
    if min_tokens >= limits.context_len:
        raise RequestError(f"This model's maximum context length is {limits.context_len} tokens; the prompt has at "
                           f"least {min_tokens} tokens.", "input_ids")
    if min_tokens >= limits.max_total_tokens:
        raise RequestError(f"the prompt has at least {min_tokens} tokens, more than the KV cache holds "
                           f"({limits.max_total_tokens} tokens)", "input_ids")


def fit_request(ids: list[int], params: SamplingParams,
                limits: RequestLimits) -> tuple[list[int], SamplingParams, str | None]:
    """--allow-auto-truncate: the prompt cut to its first tokens and an explicit max_new_tokens lowered so that
    `check_request` takes them (one generated token at least); returns them with what was cut, in words (None:
    nothing). Empty prompts and token ids out of range stay errors for `check_request`."""
    fits = min(limits.context_len, limits.max_total_tokens)
    cut = []
    if len(ids) >= fits:
        cut.append(f"prompt of {len(ids)} tokens cut to its first {fits - 1}")
        ids = ids[: fits - 1]
    want, room = params.max_new_tokens, fits - len(ids)
    if want is not None and want > room and "max_new_tokens" in params.model_fields_set:
        cut.append(f"max_new_tokens {want} lowered to {room}")
        params = params.model_copy(update={"max_new_tokens": room})
    return ids, params, "; ".join(cut) or None


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended; `to_json()` is SGLang's `meta_info.finish_reason`."""

    kind: Literal["stop", "length", "abort"]
    matched: int | str | None = None     # stop: the token id or the stop string
    length: int | None = None            # length: the max_new_tokens reached
    message: str | None = None           # abort: why, for the user
    status_code: int | None = None       # abort: the HTTP status of the error (None: cancelled by the caller)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        for name in ("matched", "length", "message", "status_code"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass
class RequestSpec:
    """What a submitter asks for (token ids only): the scheduler's `Req` and the IPC message both start here."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int                     # the sampling seed: params.seed, else drawn by the tokenizer manager
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    grammar_start_id: int | None = None   # the grammar applies after this output token (`</think>`); None: from the start

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
    finished: FinishReason | None = None
    admitted_once: bool = False
    # log-probs gathered so far: (logprob | None, token_id); top: list of (logprob, token_id) per position
    input_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    sent_len: int = 0                      # output tokens already sent to the manager
    spec_verify_ct: int = 0                # speculative verify steps run for it
    spec_tokens: int = 0                   # output tokens they produced (accepted drafts + one each)
    # the latest batch planned with it (speculative decoding: while that batch is queued and unprocessed, its
    # next step's base is known on the device only; `scheduler/decode.spec_columns`)
    last_batch: object | None = field(default=None, repr=False, compare=False)

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
    global_num_tokens: list[int] | None = None   # DP attention: tokens of each DP group this step (agreed)
    slot_tokens: list[list[int]] | None = None   # DP attention: [forward of the step][group] tokens (agreed)
    # --enable-mixed-chunk: an EXTEND batch whose last num_decode requests are running decodes riding along, one
    # token each; their input ids are read on the device like a DECODE batch's (input_ids holds placeholders)
    num_decode: int = 0
    # DP attention: the decode CUDA graph size every rank replays this step (agreed; None: eager)
    graph_bs: int | None = None
    # DP attention: the token count of the piecewise extend graphs every rank runs this step (agreed; None: eager)
    piece_tokens: int | None = None

    @property
    def size(self) -> int:
        return len(self.reqs)

    def is_decode(self, i: int) -> bool:
        """True when request i of the batch decodes this step (a DECODE batch, or the tail of a mixed one)."""
        return self.mode is ForwardMode.DECODE or i >= len(self.reqs) - self.num_decode

    @functools.cached_property
    def decode_ids(self) -> frozenset[int]:
        """id() of each request that decodes this step (`is_decode`), for membership tests by request."""
        reqs = self.reqs if self.mode is ForwardMode.DECODE else self.reqs[len(self.reqs) - self.num_decode:]
        return frozenset(id(r) for r in reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
