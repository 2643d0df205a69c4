"""DeepSeek tool-call parsers: the documented formats, malformed text as content, streaming == non-streaming."""
from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaserve.server.tool_parser import (
    TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP, ToolCallDelta,
    create_tool_parser, tool_finish_reason,
)

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time", "search")]
ID_RE = re.compile(r"^call_[0-9a-f]{24}$")


def v3_call(name: str, args: str) -> str:
    return f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n{args}\n```{TOOL_CALL_END}"


def v31_call(name: str, args: str) -> str:
    return f"{TOOL_CALL_BEGIN}{name}{TOOL_SEP}{args}{TOOL_CALL_END}"


CALL = {"deepseekv3": v3_call, "deepseekv31": v31_call}


def block(*calls: str, sep: str = "") -> str:
    return TOOL_CALLS_BEGIN + sep.join(calls) + TOOL_CALLS_END


def simple(calls) -> list[tuple[int, str, str]]:
    return [(c.index, c.name, c.arguments) for c in calls]


def run_stream(parser, pieces: list[str], tools=None) -> tuple[str | None, list[tuple[int, str, str]]]:
    """Feed pieces, check the delta contract, and merge the deltas like an OpenAI client would."""
    content, merged = [], {}
    outs = [parser.stream(p, tools) for p in pieces] + [parser.finish()]
    for text, deltas in outs:
        content.append(text)
        for d in deltas:
            assert isinstance(d, ToolCallDelta)
            if d.index not in merged:  # first delta of a call: id + name, no arguments yet
                assert d.index == len(merged) and ID_RE.match(d.id) and d.name and d.arguments == ""
                merged[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None
                merged[d.index][1] += d.arguments
    return "".join(content) or None, [(i, n, a) for i, (n, a) in sorted(merged.items())]


def random_pieces(text: str, rng: random.Random) -> list[str]:
    mode = rng.randrange(4)
    if mode == 0:
        return list(text)
    if mode == 1:
        return [text]
    cuts, i = [], 0
    while i < len(text):
        step = rng.randint(1, 3 if mode == 2 else 25)
        cuts.append(text[i:i + step])
        i += step
    return cuts


def test_brief_example_v3():
    text = ("Some text" + block(v3_call("get_weather", '{"city": "Qingdao"}'),
                                v3_call("get_time", '{"tz": "Asia/Shanghai"}')))
    content, calls = create_tool_parser("deepseekv3").parse(text, TOOLS)
    assert content == "Some text"
    assert simple(calls) == [(0, "get_weather", '{"city": "Qingdao"}'), (1, "get_time", '{"tz": "Asia/Shanghai"}')]
    assert all(ID_RE.match(c.id) for c in calls) and calls[0].id != calls[1].id
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Qingdao"}'}}
    assert tool_finish_reason("stop", bool(calls)) == "tool_calls"
    assert tool_finish_reason("length", True) == "length" and tool_finish_reason("stop", False) == "stop"


def test_brief_example_v31():
    text = "Let me check." + block(v31_call("get_weather", '{"city": "Qingdao"}'), v31_call("search", '{"q": "x"}'))
    content, calls = create_tool_parser("deepseekv31").parse(text, TOOLS)
    assert content == "Let me check."
    assert simple(calls) == [(0, "get_weather", '{"city": "Qingdao"}'), (1, "search", '{"q": "x"}')]


@pytest.mark.parametrize("fmt", sorted(CALL))
def test_plain_text_and_calls_only(fmt):
    parser = create_tool_parser(fmt)
    text = "Just an answer, with a fence ```json\n{}\n``` and <｜tool▁sep｜> but no block.\n"
    assert parser.parse(text, TOOLS) == (text, [])
    # V3's chat template puts "\n" between calls; whitespace around the block is not content.
    content, calls = parser.parse("\n\n" + block(CALL[fmt]("search", "{}"), CALL[fmt]("search", "{}"),
                                                 sep="\n") + "\n", TOOLS)
    assert content is None and simple(calls) == [(0, "search", "{}"), (1, "search", "{}")]


@pytest.mark.parametrize("fmt", sorted(CALL))
def test_unicode_and_newlines_in_arguments(fmt):
    args = json.dumps({"city": "青岛 🌊", "note": "line1\nline2", "nested": {"list": [1, 2.5, None]}},
                      ensure_ascii=False, indent=2)
    content, calls = create_tool_parser(fmt).parse("天气？\n" + block(CALL[fmt]("get_weather", "  " + args + "\n")))
    assert content == "天气？"
    assert simple(calls) == [(0, "get_weather", args)]  # as written, stripped
    assert json.loads(calls[0].arguments)["city"] == "青岛 🌊"


def malformed_cases(fmt: str) -> list[tuple[str, str | None, list[str]]]:
    """(text, expected content, expected call names) for malformed markup."""
    call = CALL[fmt]
    ok = call("search", '{"q": 1}')
    bad_json = call("search", '{"q": 1')
    not_object = call("search", "[1, 2]")
    unknown = call("launch_rockets", "{}")
    unfinished = f'{TOOL_CALL_BEGIN}search{TOOL_SEP}{{"q": "truncat'
    no_sep = f"{TOOL_CALL_BEGIN}search {{}}{TOOL_CALL_END}"
    cases = [
        ("A" + block(bad_json), "A" + bad_json, []),
        ("A" + block(not_object), "A" + not_object, []),
        ("A" + block(unknown, ok), "A" + unknown, ["search"]),  # bad call -> content, block goes on
        ("A" + TOOL_CALLS_BEGIN + ok + unfinished, "A" + unfinished, ["search"]),
        ("A" + TOOL_CALLS_BEGIN + ok, "A", ["search"]),  # block never closed
        ("A" + block(no_sep), "A" + no_sep, []),
        ("A" + TOOL_CALLS_BEGIN + ok + " junk " + ok, "A junk " + ok, ["search"]),  # junk ends the block
        ("A " + TOOL_CALLS_BEGIN[:-3], "A " + TOOL_CALLS_BEGIN[:-3], []),  # partial token at the end
        ("A" + TOOL_CALLS_BEGIN + "\n" + TOOL_CALL_BEGIN[:5], "A\n" + TOOL_CALL_BEGIN[:5], []),
        (ok + "A", ok + "A", []),  # a call outside a block is plain text
    ]
    if fmt == "deepseekv3":
        raw = f'{TOOL_CALL_BEGIN}search{TOOL_SEP}x\n```json\n{{}}\n```{TOOL_CALL_END}'
        fenceless = f'{TOOL_CALL_BEGIN}function{TOOL_SEP}search\n{{"q": 2}}{TOOL_CALL_END}'
        open_fence = f'{TOOL_CALL_BEGIN}function{TOOL_SEP}search\n```json\n{{}}{TOOL_CALL_END}'
        cases += [("A" + block(raw), "A" + raw, []),  # no "function" type
                  ("A" + block(fenceless), "A", ["search"]),  # missing fence is tolerated
                  ("A" + block(open_fence), "A" + open_fence, [])]
    return cases


@pytest.mark.parametrize("fmt", sorted(CALL))
def test_malformed_is_content_in_both_modes(fmt):
    for text, want_content, want_names in malformed_cases(fmt):
        content, calls = create_tool_parser(fmt).parse(text, TOOLS)
        assert (content, [c.name for c in calls]) == (want_content, want_names), text
        stream_content, stream_calls = run_stream(create_tool_parser(fmt), list(text), TOOLS)
        assert (stream_content, stream_calls) == (content, simple(calls)), text


@pytest.mark.parametrize("fmt", sorted(CALL))
def test_tools_none_accepts_any_name(fmt):
    text = block(CALL[fmt]("launch_rockets", "{}"))
    assert simple(create_tool_parser(fmt).parse(text, None)[1]) == [(0, "launch_rockets", "{}")]
    assert create_tool_parser(fmt).parse(text, TOOLS) == (text[len(TOOL_CALLS_BEGIN):-len(TOOL_CALLS_END)], [])


def test_stream_holds_partial_token_and_emits_text_early():
    parser = create_tool_parser("deepseekv3")
    assert parser.stream("Hello there", TOOLS) == ("Hello there", [])  # no waiting for finish
    assert parser.stream(" <｜tool▁calls", TOOLS) == ("", [])  # could be the begin token
    assert parser.stream("▁begin｜>" + TOOL_CALL_BEGIN + "function", TOOLS) == ("", [])
    text, deltas = parser.stream(f'{TOOL_SEP}search\n```json\n{{"q": "a"}}\n```{TOOL_CALL_END}', TOOLS)
    assert text == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "search", ""),
                                                                               (0, None, '{"q": "a"}')]
    assert deltas[0].to_openai()["function"] == {"name": "search", "arguments": ""}
    assert parser.finish() == ("", [])
    # the same prefix that never becomes a token is flushed verbatim at the end
    parser.stream("Hello <｜tool▁calls", TOOLS)
    assert parser.finish() == (" <｜tool▁calls", [])


def random_message(fmt: str, rng: random.Random) -> str:
    call = CALL[fmt]
    words = ["Sure.", "让我查一下", " ", "\n", "```json\n{}\n```", "<", "<｜", TOOL_SEP, TOOL_CALL_END]
    args = [json.dumps({"city": rng.choice(["Qingdao", "北京", "a\nb", "}{"])}, ensure_ascii=rng.random() < 0.5),
            "{}", '{"broken": ', "[]"]
    names = ["get_weather", "search", "unknown_fn"]
    parts = [rng.choice(words) for _ in range(rng.randrange(3))]
    for _ in range(rng.randrange(3)):
        calls = [call(rng.choice(names), rng.choice(args)) for _ in range(rng.randrange(4))]
        if rng.random() < 0.2:
            calls.append(TOOL_CALL_BEGIN + "search" + TOOL_SEP + "{")  # unfinished
        parts.append(TOOL_CALLS_BEGIN + rng.choice(["", "\n"]).join(calls)
                     + (TOOL_CALLS_END if rng.random() < 0.8 else "") + rng.choice(["", "\n", " tail"]))
    return "".join(parts)


@pytest.mark.parametrize("fmt", sorted(CALL))
def test_random_split_streams_equal_parse(fmt):
    rng = random.Random()
    for _ in range(200):
        text = random_message(fmt, rng)
        tools = TOOLS if rng.random() < 0.7 else None
        content, calls = create_tool_parser(fmt).parse(text, tools)
        assert run_stream(create_tool_parser(fmt), random_pieces(text, rng), tools) == (content, simple(calls)), text


# Adversarial texts: fragments of the grammar in any order, split anywhere.
FRAGMENTS = [TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP,
             TOOL_CALLS_BEGIN[:7], TOOL_CALL_END[:9], "<｜tool▁call", "function", "search", "get_weather",
             "\n", " ", "```json\n", "\n```", '{"a": "é\\n"}', "{}", "{", "x", "<"]


@pytest.mark.parametrize("fmt", sorted(CALL))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_hypothesis_streams_equal_parse(fmt, data):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=14)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    tools = data.draw(st.sampled_from([None, TOOLS]))
    content, calls = create_tool_parser(fmt).parse(text, tools)
    assert run_stream(create_tool_parser(fmt), pieces, tools) == (content, simple(calls))


def test_parser_is_reusable_after_finish():
    parser = create_tool_parser("deepseekv31")
    text = "x" + block(v31_call("search", "{}"))
    assert run_stream(parser, [text], TOOLS) == ("x", [(0, "search", "{}")])
    assert run_stream(parser, list(text), TOOLS) == ("x", [(0, "search", "{}")])


def test_unknown_parser_names_choices():
    with pytest.raises(ValueError, match="deepseekv3.*deepseekv31"):
        create_tool_parser("llama3")
