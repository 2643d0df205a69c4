"""Messages between the tokenizer manager (main process) and the schedulers, and their codec (pickle over ZMQ)."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from mlaserve.core import FinishReason, RequestSpec


@dataclass
class GenerateReqMsg(RequestSpec):
    """A new request, manager -> scheduler (already checked by `core.check_request`, its seed chosen)."""


@dataclass
class AbortReqMsg:
    rid: str


@dataclass
class FlushCacheReqMsg:
    pass


@dataclass
class GetStatsReqMsg:
    pass


@dataclass
class GrammarCheckReqMsg:
    """Is this grammar valid? (manager -> scheduler, answered at once with GrammarCheckRespMsg of the same key)."""

    key: str
    kind: str        # a core.GRAMMAR_KINDS name
    text: str


@dataclass
class GrammarCheckRespMsg:
    key: str
    error: str | None        # None: valid; else why not, in one line


@dataclass
class ReqOutput:
    """What one step produced for one request (deltas since the last message)."""

    rid: str
    new_ids: list[int]
    finished: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_logprobs: list = field(default_factory=list)        # [(logprob, id)] for new_ids
    new_top_logprobs: list = field(default_factory=list)    # [[(logprob, id), ...]] for new_ids
    input_logprobs: list | None = None                      # once, when the prompt is done
    input_top_logprobs: list | None = None
    spec_verify_ct: int = 0                                 # speculative verify steps so far (cumulative)
    spec_tokens: int = 0                                    # output tokens those steps produced (cumulative)


@dataclass
class BatchOutMsg:
    outputs: list[ReqOutput]


@dataclass
class FlushCacheRespMsg:
    ok: bool


@dataclass
class StatsMsg:
    stats: dict[str, Any]


def encode(msg: object) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> object:
    return pickle.loads(data)
