"""Pydantic models of the HTTP API: OpenAI chat / completions requests, the native /generate, /tokenize and
/detokenize requests, and the OpenAI error body. Unknown fields are ignored, as OpenAI-compatible servers do.
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic.functional_validators import AfterValidator

from mlaserve.core import (
    INT64_MIN, LogitBias, MaxNewTokens, MinP, Penalty, RepetitionPenalty, RequestError, SamplingParams, Seed, Stop,
    Temperature, Text, TokenId, TopK, TopP, check_utf8,
)

MAX_N = 64              # most choices per request
MAX_TOP_LOGPROBS = 20   # OpenAI's limit for chat top_logprobs
# SamplingParams (SGLang) names -> the OpenAI request field a user wrote
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                "sampling_params.json_schema": "response_format", "sampling_params.regex": "regex",
                "sampling_params.ebnf": "ebnf", "sampling_params.structural_tag": "tools"}
JSON_OBJECT_SCHEMA = '{"type": "object", "additionalProperties": true}'    # response_format json_object


def _utf8_deep(value: Any) -> Any:
    if isinstance(value, str):
        check_utf8(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _utf8_deep(k)
            _utf8_deep(v)
    elif isinstance(value, list):
        for v in value:
            _utf8_deep(v)
    return value


JSONObject = Annotated[dict[Text, Any], AfterValidator(_utf8_deep)]


class APIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- errors -----------------------------------------------------------------------------------------

class APIError(Exception):
    """An error returned to the client in OpenAI's shape (`code`: OpenAI's error code, default the status)."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 type: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status_code = message, param, status_code
        self.type, self.code = type or error_type(status_code), code


def error_type(status_code: int) -> str:
    return {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}.get(
        status_code, "invalid_request_error" if status_code < 500 else "internal_server_error")


def error_body(message: str, param: str | None, status_code: int, type: str | None = None,
               code: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI's API answers (code: the HTTP status unless
    OpenAI names one, e.g. "model_not_found")."""
    return {"error": {"message": message, "type": type or error_type(status_code), "param": param,
                      "code": code or status_code}}


def _field_parts(loc: tuple) -> list[str]:
    """The parts of a pydantic location that name a field or an index; the body prefix and pydantic's type /
    union tags are dropped."""
    out = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif part.isidentifier() and not part[0].isupper() and part not in ("str", "int", "float", "bool", "list",
                                                                              "dict", "none"):
            out.append(f".{part}" if out else part)
    return out


def field_name(loc: tuple) -> str | None:
    """`("body", "messages", 0, "role")` -> "messages[0].role"; pydantic's type / union tags are dropped."""
    return "".join(_field_parts(loc)) or None


def describe_errors(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the first field named, with every complaint about it.

    A value that fails every member of a union gets one error per member; the member that got furthest into the
    value (the deepest location) names the cause: `content: [{"type": "text"}]` is missing `content[0].text`, not
    "not a string". Members that failed at the same place are listed together ("... ; or ...")."""
    named = [(_field_parts(tuple(e["loc"])), e["msg"]) for e in errors]
    same = [(parts, msg) for parts, msg in named if parts[:1] == named[0][0][:1]]
    deepest = max((parts for parts, _ in same), key=len)          # the first of the deepest
    param = "".join(deepest) or None
    msgs = list(dict.fromkeys(msg.removeprefix("Value error, ") for parts, msg in same if parts == deepest))
    return f"Invalid value for '{param}': {'; or '.join(msgs)}", param


def request_error(e: ValidationError) -> RequestError:
    """A ValidationError of the Engine API as the RequestError an HTTP client would get."""
    return RequestError(*describe_errors(e.errors()))


# --- sampling fields shared by chat and completions --------------------------------------------------

class StreamOptions(APIModel):
    include_usage: StrictBool = False


class JSONSchemaFormat(APIModel):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")] = "response"
    description: Text | None = None
    schema_: Annotated[JSONObject, Field(alias="schema")] = {}
    strict: StrictBool | None = None


class ResponseFormat(APIModel):
    """OpenAI `response_format`: free text, any JSON object, or JSON matching `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema, strict})")
        return self

    def json_schema_text(self) -> str | None:
        """The constraint as SamplingParams.json_schema (None for text)."""
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.type == "json_schema":
            return json.dumps(self.json_schema.schema_)
        return None


class SamplingFields(APIModel):
    """The OpenAI names of the sampling parameters, typed as `core.SamplingParams` declares them."""

    model: Text | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # extra (SGLang / vLLM) parameters
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MaxNewTokens = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    # structured output (SGLang's extra fields; response_format is OpenAI's)
    response_format: ResponseFormat | None = None
    regex: Text | None = None
    ebnf: Text | None = None

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):          # OpenAI answers 400 too
            raise ValueError("stream_options needs stream: true")
        return v

    def sampling_params(self, max_new_tokens: int | None, index: int = 0) -> SamplingParams:
        """The SamplingParams of choice `index` (with a seed, choice i uses seed + i); RequestError in OpenAI names."""
        p: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos,
                             "min_new_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
                             "no_stop_trim": self.no_stop_trim}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "stop_token_ids", "stop", "logit_bias"):
            if getattr(self, name) is not None:
                p[name] = getattr(self, name)
        if self.seed is not None:       # wraps within int64: any valid seed works with any n
            p["seed"] = (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        schema = self.response_format.json_schema_text() if self.response_format is not None else None
        for name, value in (("json_schema", schema), ("regex", self.regex), ("ebnf", self.ebnf)):
            if value is not None:
                p[name] = value
        try:
            return SamplingParams(**p)
        except ValidationError as e:
            raise request_error(e).renamed(OPENAI_NAMES) from None


# --- chat ----------------------------------------------------------------------------------------------

class ContentPart(APIModel):
    type: Literal["text"]
    text: Text


class FunctionCall(APIModel):
    name: Text
    arguments: Text | JSONObject = "{}"


class ToolCallIn(APIModel):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(APIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        # NOTE: before the union's own checks, whose first complaint ("should be a valid string") hides the cause
        if isinstance(v, list):
            for p in v:
                kind = p.get("type") if isinstance(p, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported: DeepSeek V2 / V3 models "
                                     f"read text only (parts of type 'text')")
        return v

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
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None


class Tool(APIModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(APIModel):
    name: Text


class NamedToolChoice(APIModel):
    type: Literal["function"]
    function: NamedFunction


# names the chat template is rendered with; a chat_template_kwargs key may not replace them
TEMPLATE_ARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token",
                 "raise_exception", "strftime_now")


def _template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(set(kwargs) & set(TEMPLATE_ARGS))
    if taken:
        raise ValueError(f"may not set {', '.join(taken)} (the server renders the template with them)")
    return kwargs


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxNewTokens | None = None           # None: as many as fit
    max_completion_tokens: MaxNewTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: Annotated[JSONObject, AfterValidator(_template_kwargs)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):                 # OpenAI: logprobs must be true to use it
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- completions -------------------------------------------------------------------------------------

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompt = Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: MaxNewTokens | None = 16             # None: as many as fit
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: Text | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one text or one token-id list per prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# --- native API ---------------------------------------------------------------------------------------

class GenerateRequest(APIModel):
    """The native request (SGLang's /generate and Engine.generate): one prompt or a batch."""

    text: Text | Annotated[list[Text], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: StrictBool = False
    logprob_start_len: Annotated[StrictInt, Field(ge=-1)] = -1      # -1: output tokens only
    top_logprobs_num: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    stream: StrictBool = False
    rid: Text | Annotated[list[Text], Field(min_length=1)] | None = None    # a batch: one per prompt (SGLang)

    @field_validator("logprob_start_len", "top_logprobs_num")
    @classmethod
    def _needs_return_logprob(cls, v: int, info: ValidationInfo) -> int:
        # NOTE: both shape the log-probs return_logprob asks for; without it they would act on nothing
        if v != (-1 if info.field_name == "logprob_start_len" else 0) and not info.data.get("return_logprob"):
            raise ValueError(f"{info.field_name} needs return_logprob: true")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self


class AbortRequest(APIModel):
    """SGLang's /abort_request: one running request by its rid, or every one."""
    rid: Text | None = None
    abort_all: StrictBool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("give a rid or abort_all: true (not both)")
        return self


class TokenizeRequest(APIModel):
    prompt: Text | Annotated[list[ChatMessage], Field(min_length=1)]
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

