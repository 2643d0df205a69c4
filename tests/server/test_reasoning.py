"""DeepSeek reasoning parser: `<think>` splitting for R1 and V3 modes, streaming == non-streaming."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaserve.server.reasoning import create_reasoning_parser


def run_stream(parser, pieces: list[str]) -> tuple[str | None, str | None]:
    outs = [parser.stream(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in outs) or None, "".join(c for _, c in outs) or None


@pytest.mark.parametrize("text, want", [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", ("The user greets me.", "Hello!")),
    ("The user greets me.\n</think>\n\nHello!", ("The user greets me.", "Hello!")),  # prompt ended with <think>
    ("\n<think>Still thinking, cut by max_tokens", ("Still thinking, cut by max_tokens", None)),
    ("no tags at all", ("no tags at all", None)),
    ("<think>\n\n</think>\n\nHi", (None, "Hi")),  # empty reasoning
    ("<think>a</think>b</think>c\n", ("a", "b</think>c\n")),  # only the first close splits
    ("<think>a <think> b</think>", ("a <think> b", None)),
    ("", (None, None)),
])
def test_deepseek_r1(text, want):
    assert create_reasoning_parser("deepseek-r1").parse(text) == want
    assert run_stream(create_reasoning_parser("deepseek-r1"), list(text)) == want


@pytest.mark.parametrize("text, want", [
    ("<think>\nplan\n</think>\n\nanswer", ("plan", "answer")),
    ("  plain answer </think> stays\n", (None, "  plain answer </think> stays\n")),  # verbatim
    ("<thin", (None, "<thin")),
    ("<think>unfinished", ("unfinished", None)),
])
def test_deepseek_v3(text, want):
    assert create_reasoning_parser("deepseek-v3").parse(text) == want
    assert run_stream(create_reasoning_parser("deepseek-v3"), list(text)) == want


def test_stream_is_incremental():
    parser = create_reasoning_parser("deepseek-r1")
    assert parser.stream("<think>\nFirst ") == ("First", "")  # trailing space may end the reasoning
    assert parser.stream("idea.</th") == (" idea.", "")  # partial close tag held back
    assert parser.stream("ink>\n\nThe answer") == ("", "The answer")
    assert parser.stream(" is 42.") == ("", " is 42.")
    assert parser.finish() == ("", "")
    # reusable after finish; a partial tag that never completes is reasoning text
    assert run_stream(parser, ["abc </thi"]) == ("abc </thi", None)


def random_text(rng: random.Random) -> str:
    words = ["<think>", "</think>", "<think", "</thi", "\n", "\n\n", " ", "推理", "answer", "x", "<", "</"]
    return "".join(rng.choice(words) for _ in range(rng.randrange(12)))


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name", ["deepseek-r1", "deepseek-v3"])
def test_random_split_streams_equal_parse(name):
    rng = random.Random()
    for _ in range(200):
        text = random_text(rng)
        want = create_reasoning_parser(name).parse(text)
        assert run_stream(create_reasoning_parser(name), random_pieces(text, rng)) == want, text


@pytest.mark.parametrize("name", ["deepseek-r1", "deepseek-v3"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_hypothesis_streams_equal_parse(name, data):
    alphabet = st.sampled_from(["<think>", "</think>", "<", "/", "t", "h", "i", "n", "k", ">", " ", "\n", "é"])
    text = "".join(data.draw(st.lists(alphabet, max_size=20)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert run_stream(create_reasoning_parser(name), pieces) == create_reasoning_parser(name).parse(text)


def test_unknown_parser_names_choices():
    with pytest.raises(ValueError, match="deepseek-r1.*deepseek-v3"):
        create_reasoning_parser("qwen3")
