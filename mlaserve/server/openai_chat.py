"""`/v1/chat/completions`: chat template + tools -> prompt ids, n requests, and the answer split by the reasoning
parser first and the tool-call parser on its content, streamed or whole (both give the same split)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from mlaserve.core import SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.server.manager import GenerateInput
from mlaserve.server.openai_common import (
    ServingContext, chat_logprobs, check_grammars, encode_prompt, finish_reason, matched_stop, new_id, prepare,
    stream_end, usage,
)
from mlaserve.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice
from mlaserve.server.reasoning import create_reasoning_parser
from mlaserve.server.sse import collect, merge, sse
from mlaserve.server.structured import grammar_start_id, tool_call_tag
from mlaserve.server.tool_parser import create_tool_parser, tool_finish_reason


class ChoiceParser:
    """Splits one choice's text into (reasoning, content, tool calls); one instance per choice."""

    def __init__(self, reasoning_parser: str | None, tool_parser: str | None, tools: list[dict] | None):
        self.reasoning = create_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.tool = create_tool_parser(tool_parser) if tool_parser and tools is not None else None
        self.tools = tools
        self.made_calls = False

    def parse(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        calls: list = []
        if self.tool is not None and content:
            content, calls = self.tool.parse(content, self.tools)
        self.made_calls = bool(calls)
        return reasoning, content, [c.to_openai() for c in calls]

    def stream(self, delta: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """(reasoning delta, content delta, tool-call deltas); `final` flushes what was held back."""
        reasoning, content = "", delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.stream(delta)
            if final:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        if self.tool is None:
            return reasoning, content, []
        content, deltas = self.tool.stream(content, self.tools)
        if final:
            c, d = self.tool.finish()
            content, deltas = content + c, deltas + d
        self.made_calls = self.made_calls or bool(deltas)
        return reasoning, content, [d.to_openai() for d in deltas]


# --- request -> GenerateInputs ----------------------------------------------------------------------------

def resolve_tools(req: ChatCompletionRequest, ctx: ServingContext) -> tuple[list[dict] | None, list[dict] | None]:
    """(tools shown to the template, tools the parser accepts: None = no tool-call parsing)."""
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if not req.tools:
        if named is not None or choice == "required":
            raise APIError("tool_choice requires a non-empty tools list", "tool_choice")
        return None, None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "none":
        return None, None
    if named is not None:
        tools = [t for t in tools if t["function"]["name"] == named]
        if not tools:
            raise APIError(f"tool_choice names the function {named!r}, which is not in tools",
                           "tool_choice.function.name")
    if ctx.server.tool_call_parser is None:
        if named is not None or choice == "required":
            raise APIError("tool_choice 'required' or a named function needs the server to be started with "
                           "--tool-call-parser", "tool_choice")
        return tools, None
    return tools, tools


def chat_prompt_ids(req: ChatCompletionRequest, ctx: ServingContext, tools: list[dict] | None) -> list[int]:
    messages = [m.to_template() for m in req.messages]
    kwargs = req.chat_template_kwargs or {}
    try:
        text = ctx.tokenizer.apply_chat_template(messages, tools, True, **kwargs)
    except Exception as e:  # noqa: BLE001 - the template runs on what the request sent
        param = "chat_template_kwargs" if kwargs else "messages"
        raise APIError(f"the chat template failed on this request: {type(e).__name__}: {e}", param) from None
    return encode_prompt(ctx, text, "messages", add_bos=False)


def chat_inputs(req: ChatCompletionRequest, ctx: ServingContext) -> tuple[list[GenerateReqMsg], list[dict] | None]:
    """One checked request per choice (grammars not yet: `check_grammars`), and the tools the parser accepts."""
    template_tools, parse_tools = resolve_tools(req, ctx)
    ids = chat_prompt_ids(req, ctx, template_tools)
    top = (req.top_logprobs or 0) if req.logprobs else 0
    tag = forced_tool_tag(req, ctx, parse_tools)
    start = grammar_start_id(ctx.tokenizer, ctx.server.reasoning_parser)
    inputs = [GenerateInput(input_ids=ids, sampling_params=_with_tag(req.sampling_params(req.max_new_tokens, i), tag),
                            return_logprob=req.logprobs, top_logprobs_num=top, stream=req.stream,
                            grammar_start_id=start)
              for i in range(req.n)]
    return prepare(ctx, inputs, "messages"), parse_tools


def forced_tool_tag(req: ChatCompletionRequest, ctx: ServingContext, parse_tools: list[dict] | None) -> str | None:
    """The structural tag that makes the reply tool calls only (tool_choice "required" or a named function),
    or None when tool calls are not forced."""
    if parse_tools is None or not (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)):
        return None
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError("response_format cannot be combined with tool_choice 'required' or a named function "
                       "(the reply is tool calls)", "response_format")
    return tool_call_tag(ctx.server.tool_call_parser, parse_tools, req.parallel_tool_calls is not False)


def _with_tag(params: SamplingParams, tag: str | None) -> SamplingParams:
    if tag is None:
        return params
    if params.grammar is not None:
        raise APIError(f"{params.grammar[0]} cannot be combined with tool_choice 'required' or a named function "
                       "(the reply is tool calls)", params.grammar[0])
    return params.model_copy(update={"structural_tag": tag})


def _parser(ctx: ServingContext, parse_tools: list[dict] | None) -> ChoiceParser:
    return ChoiceParser(ctx.server.reasoning_parser, ctx.server.tool_call_parser, parse_tools)


# --- whole answer -------------------------------------------------------------------------------------------

async def chat_completion(req: ChatCompletionRequest, ctx: ServingContext) -> dict:
    inputs, parse_tools = chat_inputs(req, ctx)
    await check_grammars(ctx, inputs)
    snaps = await collect([ctx.manager.generate(obj) for obj in inputs])
    choices = [_choice(i, s, req, ctx, _parser(ctx, parse_tools)) for i, s in enumerate(snaps)]
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": ctx.created, "model": ctx.model_name,
            "choices": choices, "usage": usage(snaps, req.n).model_dump()}


def _choice(i: int, snap: dict, req: ChatCompletionRequest, ctx: ServingContext, parser: ChoiceParser) -> dict:
    meta = snap["meta_info"]
    reason = finish_reason(meta)
    reasoning, content, calls = parser.parse(snap["text"])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if parser.reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    logprobs = None
    if req.logprobs:
        logprobs = chat_logprobs(ctx.tokenizer, meta.get("output_token_logprobs", []),
                                 meta.get("output_top_logprobs"))
    return {"index": i, "message": message, "logprobs": logprobs,
            "finish_reason": tool_finish_reason(reason, parser.made_calls), "matched_stop": matched_stop(meta)}


# --- streamed answer ---------------------------------------------------------------------------------------

async def chat_stream(req: ChatCompletionRequest, ctx: ServingContext, inputs: list[GenerateReqMsg],
                      parse_tools: list[dict] | None) -> AsyncIterator[str]:
    """SSE chunks of every choice (role first, then deltas, then finish_reason), usage if asked, [DONE].
    Errors after the headers went out are sent as an `{"error": ...}` event (by SSEResponse)."""
    rid, n = new_id("chatcmpl"), len(inputs)
    base = {"id": rid, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model_name}

    def chunk(i: int, delta: dict, reason: str | None = None, logprobs: dict | None = None) -> str:
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse({**base, "choices": [choice]})

    parsers = [_parser(ctx, parse_tools) for _ in range(n)]
    sent_text, sent_tokens, finals = [0] * n, [0] * n, [None] * n
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, snap in merge([ctx.manager.generate(obj) for obj in inputs]):
        meta, text = snap["meta_info"], snap["text"]
        reason = finish_reason(meta)
        reasoning, content, calls = parsers[i].stream(text[sent_text[i]:], final=reason is not None)
        sent_text[i] = len(text)
        logprobs = None
        if req.logprobs:
            lps = meta.get("output_token_logprobs", [])
            tops = meta.get("output_top_logprobs")
            k = sent_tokens[i]
            logprobs = chat_logprobs(ctx.tokenizer, lps[k:], tops[k:] if tops else None)
            sent_tokens[i] = len(lps)
        delta = _delta(reasoning, content, calls)
        if delta or (logprobs and logprobs["content"]):
            yield chunk(i, delta, logprobs=logprobs)
        if reason is not None:
            finals[i] = snap
            yield chunk(i, {}, tool_finish_reason(reason, parsers[i].made_calls))
    for event in stream_end(req, base, finals):
        yield event


def _delta(reasoning: str, content: str, calls: list[dict]) -> dict:
    delta: dict[str, Any] = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta
