"""Structured output on the chat route: forced tool calls as an xgrammar structural tag (the model's own
tool-call markup around JSON arguments matching each function's parameter schema), and where the grammar
starts for reasoning models (after `</think>`). The scheduler compiles and enforces them (scheduler/grammar.py).
"""
from __future__ import annotations

import json
from typing import Any

from mlaserve.tokenizer import THINK_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP, Tokenizer

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
ARGS_MAX_WHITESPACE = 1      # whitespace allowed between JSON tokens of the arguments (xgrammar's least)

# per --tool-call-parser: (text before the arguments, text after them) of one call to function NAME
_CALL_FORMATS = {
    "deepseekv3": (TOOL_CALL_BEGIN + "function" + TOOL_SEP + "{name}\n```json\n", "\n```" + TOOL_CALL_END),
    "deepseekv31": (TOOL_CALL_BEGIN + "{name}" + TOOL_SEP, TOOL_CALL_END),
}


def tool_call_tag(parser: str, tools: list[dict], parallel: bool = True) -> str:
    """The structural tag (JSON text) of a reply made only of tool calls to `tools` (OpenAI tool dicts) in the
    markup `parser` reads: one call, or one or more when `parallel`; arguments match the function's
    `parameters` schema (an object with no properties when it has none; properties it does not list are not
    generated), with at most one whitespace character between JSON tokens."""
    begin, end = _CALL_FORMATS[parser]
    calls = [{"type": "tag", "begin": begin.format(name=t["function"]["name"]),
              "content": {"type": "json_schema", "json_schema": t["function"].get("parameters") or EMPTY_PARAMETERS,
                          "max_whitespace_cnt": ARGS_MAX_WHITESPACE},
              "end": end} for t in tools]
    call: dict[str, Any] = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if parallel:
        call = {"type": "plus", "content": call}
    body = [{"type": "const_string", "value": TOOL_CALLS_BEGIN}, call,
            {"type": "const_string", "value": TOOL_CALLS_END}]
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": body}},
                      ensure_ascii=False)


def grammar_start_id(tokenizer: Tokenizer, reasoning_parser: str | None) -> int | None:
    """The output token after which a chat reply's grammar applies: `</think>` for deepseek-r1 (reasoning
    stays free), else None (from the first token)."""
    if reasoning_parser != "deepseek-r1":
        return None
    return tokenizer.token_to_id(THINK_END)
