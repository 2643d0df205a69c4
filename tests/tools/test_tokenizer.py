"""The trained tokenizer: special-token ids, round trips, HF AutoTokenizer parity and the DeepSeek-V3 chat template."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import pytest
import transformers

from mlaserve.tokenizer import BOS, EOS, SKIPPED_TOKENS, SPECIAL_TOKENS, Tokenizer, load_tokenizer
from mlaserve.tools.tokenizer import MIN_VOCAB, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
U, A, END = "<｜User｜>", "<｜Assistant｜>", EOS
CALLS_B, CALLS_E, CALL_B, CALL_E, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                         "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
OUTS_B, OUTS_E, OUT_B, OUT_E = ("<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                                "<｜tool▁output▁end｜>")

TEXTS = [
    "Hello, world! The answer is 42.",
    "  leading and trailing spaces \t\n\n",
    "人工智能正在改变我们的生活方式。東京は日本の首都です。안녕하세요",
    "emoji 😀🚀👨‍👩‍👧‍👦🇯🇵 and symbols ∑ √2 ≈ 1.414 € ©",
    'def f(x: int) -> int:\n    return {"k": [x ** 2, None]}["k"][0]\n',
    f"chat markup {U}hi{A}<think>plan</think>ok{CALLS_B}{CALL_B}function{SEP}f\n{CALL_E}{CALLS_E}",
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "城市 name"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]


def random_text(rng: random.Random, n: int = 200) -> str:
    # ASCII, Latin-1, Cyrillic, CJK, emoji: 1- to 4-byte UTF-8
    ranges = [(0x20, 0x7E), (0xA0, 0xFF), (0x410, 0x44F), (0x4E00, 0x4FFF), (0x1F600, 0x1F64F)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(n)) + "\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, float]:
    out = tmp_path_factory.mktemp("tok")
    t0 = time.process_time()  # CPU time of all threads: what training costs on one core
    n = train_tokenizer(out, 4096)
    return out, n, time.process_time() - t0


@pytest.fixture(scope="module")
def tok(trained: tuple[Path, int, float]) -> Tokenizer:
    return load_tokenizer(trained[0])


@pytest.fixture(scope="module")
def hf(trained: tuple[Path, int, float]) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(trained[0], local_files_only=True)


def test_training_is_fast_full_size_and_deterministic(trained, tok, tmp_path):
    out, n, cpu_s = trained
    assert cpu_s < 10.0, f"training took {cpu_s:.1f} s of CPU"
    assert n == 4096 == tok.vocab_size
    # a fresh process that imported nothing else (this one has torch and transformers) writes the same bytes
    code = f"from mlaserve.tools.tokenizer import train_tokenizer; print(train_tokenizer({str(tmp_path)!r}, 4096))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert int(res.stdout) == n
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(tmp_path, MIN_VOCAB - 1)


def test_special_tokens_have_fixed_single_ids(tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i
        assert tok.encode(token, add_bos=False) == [i]
        assert tok.encode(f"a{token}b", add_bos=False).count(i) == 1
        assert tok.decode([i], skip_special_tokens=False) == token
        # bos/eos/pad vanish with skip_special_tokens; think / tool / role tokens stay for the parsers
        assert tok.decode([i], skip_special_tokens=True) == ("" if token in SKIPPED_TOKENS else token)


def test_round_trip(tok):
    rng = random.Random()  # fresh text every run
    for text in [*TEXTS, random_text(rng), random_text(rng)]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text, add_bos=False)) == text
    assert max(tok.encode("".join(TEXTS))) < tok.vocab_size


def test_hf_autotokenizer_loads_offline_and_matches(trained, tok, hf):
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert len(hf) == tok.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    assert json.loads((trained[0] / "tokenizer_config.json").read_text())["add_bos_token"] is True
    for text in [*TEXTS, random_text(random.Random())]:
        ids = hf.encode(text)
        assert ids == tok.encode(text)
        assert ids[0] == 0 and ids.count(0) == 1  # BOS prepended exactly once
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_bos=False)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids) == text
        assert hf.decode(ids) == tok.decode(ids, skip_special_tokens=False) == BOS + text


def render_both(tok: Tokenizer, hf, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """Renders with HF apply_chat_template and with our jinja runtime; they must agree."""
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    tokenize=False)
    assert ours == theirs
    return ours


def test_chat_system_and_user(tok, hf):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi"}]
    assert render_both(tok, hf, msgs) == f"{BOS}You are terse.\n\nAnswer in French.{U}Hi{A}"
    assert render_both(tok, hf, msgs[2:], add_generation_prompt=False) == f"{BOS}{U}Hi"


def test_chat_multi_turn_and_content_parts(tok, hf):
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": [{"type": "text", "text": "and 3+3"}, {"type": "text", "text": "?"}]}]
    assert render_both(tok, hf, msgs) == f"{BOS}{U}2+2?{A}4{END}{U}and 3+3?{A}"


def test_chat_keeps_only_text_after_think(tok, hf):
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
            {"role": "user", "content": "Sure?"}]
    assert render_both(tok, hf, msgs) == f"{BOS}{U}2+2?{A}\n\nIt is 4.{END}{U}Sure?{A}"


def test_chat_tools_calls_and_outputs(tok, hf):
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Tokyo?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "25 C"}]
    text = render_both(tok, hf, msgs, tools=TOOLS)
    system, _, turns = text.partition(U)
    assert system.startswith(f"{BOS}Be brief.\n\n## Tools\n")
    # the tool's JSON schema, and the exact call format the tool-call parser reads
    assert f"### get_weather\nDescription: Current weather in a city\nParameters: " \
           f"{json.dumps(WEATHER, ensure_ascii=False)}\n" in system
    assert f"{CALLS_B}{CALL_B}function{SEP}FUNCTION_NAME\n```json\nARGUMENTS_AS_JSON\n```{CALL_E}{CALLS_E}" in system
    call1 = f'{CALL_B}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CALL_E}'
    call2 = f'{CALL_B}function{SEP}get_weather\n```json\n{{"city": "東京"}}\n```{CALL_E}'
    outputs = f"{OUTS_B}{OUT_B}18 C{OUT_E}\n{OUT_B}25 C{OUT_E}{OUTS_E}"  # both results in one block
    assert turns == f"Weather in Paris and Tokyo?{A}{CALLS_B}{call1}\n{call2}{CALLS_E}{END}{outputs}{A}"
    # the answer after the tool results closes the outputs block before its own turn
    more = render_both(tok, hf, [*msgs, {"role": "assistant", "content": "Mild."}], tools=TOOLS,
                       add_generation_prompt=False)
    assert more.endswith(f"{outputs}{A}Mild.{END}")
    assert render_both(tok, hf, msgs[1:]).startswith(f"{BOS}{U}")  # no tools, no system: empty system section


def test_chat_unknown_role_is_an_error(tok):
    with pytest.raises(jinja2.TemplateError, match="unknown message role"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_encode_chat_has_one_bos_and_matches_hf(tok, hf):
    msgs = [{"role": "user", "content": "Hi 你好 😀"}]
    ids = tok.encode_chat(msgs)
    assert ids[0] == 0 and ids.count(0) == 1
    assert ids == list(hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert ids[-1] == tok.token_to_id(A)


def test_runtime_import_is_light():
    code = ("import sys, mlaserve.tokenizer, mlaserve.tokenizer.detokenize; "
            "print([m for m in ('transformers', 'torch', 'jinja2') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO)
    assert res.stdout.strip() == "[]"
