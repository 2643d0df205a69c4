"""Streaming detokenization (never half a character; chunks add up to the full decode) and stop strings."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaserve.tokenizer import EOS, Tokenizer, load_tokenizer
from mlaserve.tokenizer.detokenize import (
    REPLACEMENT_CHAR, IncrementalDetokenizer, StopStream, find_stop, stop_holdback,
)
from mlaserve.tools.tokenizer import train_tokenizer

STREAM_TEXT = "Grüße! 人工智能正在改变世界。東京 😀🚀👨‍👩‍👧 ok\ndef f(x):\n    return x ** 2  # ∑ √2\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out, 1024)
    return load_tokenizer(out)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random, max_chunk: int = 4) -> list[str]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(detok.add(ids[i:i + n]))
        i += n
    return chunks


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_add_up_to_full_decode(tok, skip_special_tokens):
    rng = random.Random()  # fresh ids every run; random bytes are mostly broken UTF-8
    for _ in range(5):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 150))]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        chunks = stream(detok, ids, rng)
        assert not any(c.endswith(REPLACEMENT_CHAR) for c in chunks)
        assert "".join(chunks) + detok.flush() == tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.add([]) == "" and detok.flush() == ""


def test_multibyte_text_streams_without_broken_characters(tok):
    ids = tok.encode(STREAM_TEXT, add_bos=False)
    assert len(ids) > len(STREAM_TEXT) // 2  # small vocab: CJK and emoji are split into byte tokens
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.add([i]) for i in ids]
    assert all(REPLACEMENT_CHAR not in c for c in chunks)
    assert "".join(chunks) == STREAM_TEXT and detok.flush() == ""
    # a character spread over several tokens is held back, then released whole
    assert "" in chunks and any(len(c.encode()) >= 3 for c in chunks)


def test_prompt_context_is_not_repeated(tok):
    prompt = tok.encode("You said: 東京", add_bos=True)
    gen = tok.encode(" is the capital 😀. Next?", add_bos=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(detok.add([i]) for i in gen) + detok.flush() == " is the capital 😀. Next?"
    # a prompt cut inside a character must not glue its bytes onto the generated text
    cut = tok.encode("東", add_bos=False)
    assert len(cut) > 1
    rest = cut[1:] + gen  # starts with the continuation bytes of the cut character
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt + cut[:1])
    assert "".join(detok.add([i]) for i in rest) + detok.flush() == tok.decode(rest)


def test_skip_special_tokens(tok):
    ids = tok.encode("Done.", add_bos=False) + [tok.eos_token_id] + tok.encode("<think>x</think>", add_bos=False)
    rng = random.Random()
    skipped = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert "".join(stream(skipped, ids, rng)) + skipped.flush() == "Done.<think>x</think>"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(kept, ids, rng)) + kept.flush() == f"Done.{EOS}<think>x</think>"


def test_find_stop_and_holdback():
    assert find_stop("hello world", ["wor", "llo"]) == 2  # earliest start wins
    assert find_stop("hello", ["xyz", ""]) is None  # empty stop strings are ignored
    assert stop_holdback("answer: ###", ["####"]) == 3
    assert stop_holdback("abc", ["cde", "bcx"]) == 2
    assert stop_holdback("abc", ["abc"]) == 0  # a complete stop is found by find_stop, not held
    assert stop_holdback("abc", []) == 0


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab\n", max_size=30),
       stops=st.lists(st.text(alphabet="ab\n", max_size=4), max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=6), keep=st.booleans())
def test_stop_stream_same_result_for_any_chunking(text, stops, cuts, keep):
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    ss = StopStream(stops, keep_stop=keep)
    out = "".join(ss.add(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    index = find_stop(text, stops)
    if index is None:
        assert not ss.stopped and ss.matched is None and out + ss.flush() == text
    else:
        assert ss.stopped and text.startswith(ss.matched, index) and ss.flush() == ""
        assert out == text[:index + (len(ss.matched) if keep else 0)]
