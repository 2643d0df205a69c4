"""Pydantic models of the HTTP API: OpenAI chat / completions requests, the native /generate, /tokenize and
/detokenize requests, and the OpenAI error body. Unknown fields are ignored, as OpenAI-compatible servers do.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, model_validator

MAX_N = 64              # most choices per request
MAX_TOP_LOGPROBS = 20   # OpenAI's limit for chat top_logprobs


def _number(v: Any) -> Any:
    # NOTE: pydantic's lax float accepts "0.5" and True; OpenAI rejects both
    if isinstance(v, (str, bool)):
        raise ValueError("Input should be a number")
    return v


Number = Annotated[float, BeforeValidator(_number)]
Temperature = Annotated[Number, Field(ge=0, le=2)]
TopP = Annotated[Number, Field(gt=0, le=1)]
Penalty = Annotated[Number, Field(ge=-2, le=2)]
# NOTE: >= 1: the scheduler samples at least one token (max_tokens=0 with echo for prompt scoring is not served)
MaxTokens = Annotated[StrictInt, Field(ge=1)]


class APIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- errors -----------------------------------------------------------------------------------------

class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 type: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status_code = message, param, status_code
        self.type = type or error_type(status_code)


def error_type(status_code: int) -> str:
    return {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}.get(
        status_code, "invalid_request_error" if status_code < 500 else "internal_server_error")


def error_body(message: str, param: str | None, status_code: int, type: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI's API answers (code: the HTTP status)."""
    return {"error": {"message": message, "type": type or error_type(status_code), "param": param,
                      "code": status_code}}


# --- sampling fields shared by chat and completions --------------------------------------------------

class StreamOptions(APIModel):
    include_usage: StrictBool = False


class SamplingFields(APIModel):
    model: str | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extra (SGLang / vLLM) parameters
    top_k: StrictInt | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0, le=2)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False

    def sampling_params(self, max_new_tokens: int, index: int = 0) -> dict[str, Any]:
        """SamplingParams kwargs for choice `index` (with a seed, choice i uses seed + i)."""
        p: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos,
                             "min_new_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
                             "no_stop_trim": self.no_stop_trim}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "stop_token_ids"):
            if getattr(self, name) is not None:
                p[name] = getattr(self, name)
        if self.stop:
            p["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.seed is not None:
            p["seed"] = self.seed + index
        return p


# --- chat ----------------------------------------------------------------------------------------------

class ContentPart(APIModel):
    type: Literal["text"]
    text: str


class FunctionCall(APIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(APIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(APIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def to_template(self) -> dict[str, Any]:
        """The dict the chat template reads (developer -> system, content parts joined)."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDef(APIModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(APIModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(APIModel):
    name: str


class NamedToolChoice(APIModel):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(APIModel):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- completions -------------------------------------------------------------------------------------

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompt = str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: MaxTokens = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one text or one token-id list per prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# --- native API ---------------------------------------------------------------------------------------

class GenerateRequest(APIModel):
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: StrictBool = False
    logprob_start_len: StrictInt = -1
    top_logprobs_num: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    stream: StrictBool = False
    rid: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self


class TokenizeRequest(APIModel):
    prompt: str | list[ChatMessage]
    add_special_tokens: StrictBool = True


class DetokenizeRequest(APIModel):
    tokens: list[StrictInt]
    skip_special_tokens: StrictBool = False


# --- responses -----------------------------------------------------------------------------------------

class ModelCard(APIModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mlaserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(APIModel):
    object: str = "list"
    data: list[ModelCard]


class UsageInfo(APIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> UsageInfo:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details={"cached_tokens": cached})

