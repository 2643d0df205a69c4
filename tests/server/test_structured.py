"""The chat route's structured-output pieces: OpenAI response_format -> json_schema, forced tool calls as a
structural tag that accepts exactly the markup the tool-call parser reads, and the reasoning start token."""
from __future__ import annotations

import json

import pytest

from mlaserve.server.protocol import JSON_OBJECT_SCHEMA, ChatCompletionRequest
from mlaserve.server.structured import grammar_start_id, tool_call_tag
from mlaserve.server.tool_parser import create_tool_parser
from mlaserve.tokenizer import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "now"}}]
CALLS = {
    "deepseekv3": [TOOL_CALL_BEGIN + "function" + TOOL_SEP + 'add\n```json\n{"a": 1, "b": 2}\n```' + TOOL_CALL_END,
                   TOOL_CALL_BEGIN + "function" + TOOL_SEP + "now\n```json\n{}\n```" + TOOL_CALL_END],
    "deepseekv31": [TOOL_CALL_BEGIN + 'add' + TOOL_SEP + '{"a": 1, "b": 2}' + TOOL_CALL_END,
                    TOOL_CALL_BEGIN + "now" + TOOL_SEP + "{}" + TOOL_CALL_END],
}


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_response_format_becomes_json_schema():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    p = request(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}).sampling_params(8)
    assert json.loads(p.json_schema) == schema
    assert request(response_format={"type": "json_object"}).sampling_params(8).json_schema == JSON_OBJECT_SCHEMA
    assert request(response_format={"type": "text"}).sampling_params(8).grammar is None
    assert request(regex="a|b").sampling_params(8).grammar == ("regex", "a|b")


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_tool_call_tag_accepts_what_the_parser_reads(parser):
    import xgrammar as xgr

    tag = tool_call_tag(parser, TOOLS, parallel=True)
    grammar = xgr.Grammar.from_structural_tag(tag)
    one, two = CALLS[parser]
    for text, ok in [(TOOL_CALLS_BEGIN + one + two + TOOL_CALLS_END, True),
                     (TOOL_CALLS_BEGIN + one + TOOL_CALLS_END, True),
                     (TOOL_CALLS_BEGIN + TOOL_CALLS_END, False),
                     (TOOL_CALLS_BEGIN + one.replace('"b": 2', '"b": "2"') + TOOL_CALLS_END, False),
                     ("hello " + TOOL_CALLS_BEGIN + one + TOOL_CALLS_END, False)]:
        assert _accepts(grammar, text) == ok, text
        if ok:
            _, calls = create_tool_parser(parser).parse(text, TOOLS)
            assert [c.name for c in calls][:1] == ["add"] and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    single = xgr.Grammar.from_structural_tag(tool_call_tag(parser, TOOLS[:1], parallel=False))
    assert _accepts(single, TOOL_CALLS_BEGIN + one + TOOL_CALLS_END)
    assert not _accepts(single, TOOL_CALLS_BEGIN + one + one + TOOL_CALLS_END)


def _accepts(grammar, text: str) -> bool:
    """Whether `text` is a complete sentence of `grammar` (checked on a byte-level toy vocabulary)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], stop_token_ids=[256])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


def test_grammar_starts_after_think_only_for_r1(demo_tokenizer):
    assert grammar_start_id(demo_tokenizer, "deepseek-r1") == demo_tokenizer.token_to_id("</think>")
    assert grammar_start_id(demo_tokenizer, "deepseek-v3") is None
    assert grammar_start_id(demo_tokenizer, None) is None
