"""DeepSeek tool-call parsers: turn the model's special-token tool-call markup into OpenAI `tool_calls`.

`parse` (whole text) and `stream` + `finish` (incremental) give the same result however the text is split.
"""
from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass

from mlaserve.tokenizer import (TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END,  # noqa: F401
                                 TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END, TOOL_OUTPUTS_BEGIN, TOOL_OUTPUTS_END, TOOL_SEP)

_TEXT, _BLOCK, _CALL = "text", "block", "call"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON object text as the model wrote it (stripped)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_finish_reason(finish_reason: str, made_calls: bool) -> str:
    """OpenAI reports `tool_calls` instead of `stop` when the reply holds tool calls."""
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason


def hold_back_from(text: str, token: str) -> int:
    """Index from which `text` must be held back while streaming: trailing whitespace plus any
    suffix that could be the start of `token`. Everything before it is safe to emit."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-k:]):
            return len(text[:-k].rstrip())
    return len(text.rstrip())


def tool_names(tools: list[dict] | None) -> set[str] | None:
    """Names of the request's functions (OpenAI `tools` entries); None means "accept any name"."""
    if tools is None:
        return None
    return {(t.get("function") or t).get("name") for t in tools}


def _json_object(args: str) -> str | None:
    args = args.strip()
    try:
        return args if isinstance(json.loads(args), dict) else None
    except ValueError:
        return None


class BaseToolParser(ABC):
    """Splits model output into content and tool calls.

    Grammar: content, then a block `TOOL_CALLS_BEGIN (ws* CALL)* ws* TOOL_CALLS_END`, where
    CALL = `TOOL_CALL_BEGIN body TOOL_CALL_END` and the body format is the subclass's (`parse_body`).
    Content is returned verbatim except that whitespace touching a block (just before its begin
    token, just after its end token, between calls) is dropped; empty content is None from `parse`
    and "" from `stream`. Only `TOOL_CALLS_BEGIN` opens a block; other special tokens in content
    are plain text. Text after a block is content and may open another block.

    Malformed markup never raises; it becomes content, verbatim:
      * a call whose body does not parse, whose arguments are not a JSON object, or whose name is
        not in `tools` (when `tools` is given; None accepts any name): the call's raw text, both
        call tokens included, is content and the block goes on with the next call;
      * a call without `TOOL_CALL_END` by the end of generation: its raw text is content
        (a call runs from its begin token to the first `TOOL_CALL_END`);
      * anything else inside a block (junk text, a stray token) ends the block: from there on
        the text is content again. A block never closed just ends with the text.

    Streaming: a call is held until its `TOOL_CALL_END` arrives and is validated, so nothing is
    ever retracted; then it is released as two deltas: (index, id, name, arguments "") and
    (index, None, None, arguments). Text that could start a special token, and whitespace that
    could touch a block, is held back until disambiguated or `finish()`. Valid calls are numbered
    0, 1, ... in order; ids are "call_" + 24 random hex digits.
    """

    def __init__(self) -> None:
        self._reset()

    @abstractmethod
    def parse_body(self, body: str) -> tuple[str, str] | None:
        """(name, arguments) from the text between the call tokens, or None if malformed."""

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[ToolCall]]:
        """Non-streaming: returns (content or None, tool calls)."""
        names = tool_names(tools)
        content: list[str] = []
        calls: list[ToolCall] = []
        pos, lstrip = 0, False
        while True:
            start = text.find(TOOL_CALLS_BEGIN, pos)
            seg = text[pos:] if start < 0 else text[pos:start].rstrip()
            content.append(seg.lstrip() if lstrip else seg)
            if start < 0:
                return "".join(content) or None, calls
            pos, lstrip = self._parse_block(text, start + len(TOOL_CALLS_BEGIN), names, content, calls)

    def _parse_block(self, text: str, pos: int, names: set[str] | None,
                     content: list[str], calls: list[ToolCall]) -> tuple[int, bool]:
        """Parse calls from `pos` (just after the block's begin token). Returns where content
        resumes and whether its leading whitespace is dropped (block closed by its end token)."""
        while True:
            i = len(text) - len(text[pos:].lstrip())
            if i == len(text):
                return i, False
            if text.startswith(TOOL_CALLS_END, i):
                return i + len(TOOL_CALLS_END), True
            if not text.startswith(TOOL_CALL_BEGIN, i):
                return pos, False
            end = text.find(TOOL_CALL_END, i + len(TOOL_CALL_BEGIN))
            if end < 0:
                content.append(text[i:])
                return len(text), False
            pos = end + len(TOOL_CALL_END)
            call = self._check_call(text[i:pos], names)
            if call is None:
                content.append(text[i:pos])
            else:
                calls.append(ToolCall(len(calls), new_call_id(), *call))

    def _check_call(self, span: str, names: set[str] | None) -> tuple[str, str] | None:
        call = self.parse_body(span[len(TOOL_CALL_BEGIN):-len(TOOL_CALL_END)])
        if call is None or (names is not None and call[0] not in names):
            return None
        return call

    # --- streaming -------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._buf = ""
        self._state = _TEXT
        self._lstrip = False
        self._n_calls = 0
        self._names: set[str] | None = None

    def stream(self, delta: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next piece of generated text. Returns (content delta, tool-call deltas)."""
        self._buf += delta
        self._names = tool_names(tools)
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush what was held back at the end of generation; the parser is then ready for reuse."""
        out = self._advance(final=True)
        self._reset()
        return out

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._state == _TEXT:
                moved = self._step_text(final, content)
            elif self._state == _BLOCK:
                moved = self._step_block(final)
            else:
                moved = self._step_call(final, content, deltas)
            if not moved:
                return "".join(content), deltas

    def _step_text(self, final: bool, content: list[str]) -> bool:
        if self._lstrip:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._lstrip = False
        start = self._buf.find(TOOL_CALLS_BEGIN)
        if start >= 0:
            content.append(self._buf[:start].rstrip())
            self._buf = self._buf[start + len(TOOL_CALLS_BEGIN):]
            self._state = _BLOCK
            return True
        cut = len(self._buf) if final else hold_back_from(self._buf, TOOL_CALLS_BEGIN)
        content.append(self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _step_block(self, final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(TOOL_CALL_BEGIN):
            self._buf, self._state = s, _CALL
            return True
        if s.startswith(TOOL_CALLS_END):
            self._buf, self._state, self._lstrip = s[len(TOOL_CALLS_END):], _TEXT, True
            return True
        if not s:
            if final:
                self._buf = ""
            return False
        if not final and (TOOL_CALL_BEGIN.startswith(s) or TOOL_CALLS_END.startswith(s)):
            return False
        self._state = _TEXT  # junk ends the block; the whitespace before it stays content
        return True

    def _step_call(self, final: bool, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        end = self._buf.find(TOOL_CALL_END, len(TOOL_CALL_BEGIN))
        if end < 0:
            if final:
                content.append(self._buf)
                self._buf = ""
            return False
        end += len(TOOL_CALL_END)
        span, self._buf, self._state = self._buf[:end], self._buf[end:], _BLOCK
        call = self._check_call(span, self._names)
        if call is None:
            content.append(span)
            return True
        name, args = call
        deltas += [ToolCallDelta(self._n_calls, new_call_id(), name, ""),
                   ToolCallDelta(self._n_calls, None, None, args)]
        self._n_calls += 1
        return True


def _valid_name(name: str) -> str | None:
    name = name.strip()
    return name if name and not any(c.isspace() or c == "`" for c in name) else None


class DeepSeekV3ToolParser(BaseToolParser):
    """DeepSeek-V3 / R1: body = "function" TOOL_SEP NAME "\\n```json\\n" ARGS "\\n```".

    The fence's "json" tag and the fence itself are optional (raw JSON is accepted too).
    """

    def parse_body(self, body: str) -> tuple[str, str] | None:
        kind, sep, rest = body.partition(TOOL_SEP)
        if not sep or kind.strip() != "function":
            return None
        name, _, args = rest.partition("\n")
        args = args.strip()
        if args.startswith("```"):
            if len(args) < 6 or not args.endswith("```"):
                return None
            args = args[3:-3]
            args = args[4:] if args.startswith("json") else args
        name, args = _valid_name(name), _json_object(args)
        return (name, args) if name and args else None


class DeepSeekV31ToolParser(BaseToolParser):
    """DeepSeek-V3.1: body = NAME TOOL_SEP ARGS (raw JSON, no type prefix, no code fence)."""

    def parse_body(self, body: str) -> tuple[str, str] | None:
        name, sep, args = body.partition(TOOL_SEP)
        if not sep:
            return None
        name, args = _valid_name(name), _json_object(args)
        return (name, args) if name and args else None


TOOL_PARSERS: dict[str, type[BaseToolParser]] = {
    "deepseekv3": DeepSeekV3ToolParser,
    "deepseekv31": DeepSeekV31ToolParser,
}


def create_tool_parser(name: str) -> BaseToolParser:
    """A fresh parser for `--tool-call-parser NAME` (one per request: streaming is stateful)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choices: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
