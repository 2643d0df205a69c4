"""Train the byte-level BPE tokenizer shipped with synthetic DeepSeek checkpoints.

Special tokens take ids 0..15 (see `mlaserve.tokenizer.SPECIAL_TOKENS`); output loads with HF `AutoTokenizer`.
Usage: `python -m mlaserve.tools.tokenizer OUT_DIR [--vocab-size 4096]`.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mlaserve.tokenizer import BOS, EOS, PAD, SKIPPED_TOKENS, SPECIAL_TOKENS, default_chat_template

MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # special tokens + one token per byte
DEFAULT_MAX_LENGTH = 131072

# Standard-library modules whose docstrings (English prose) and sources (code) feed the corpus.
DOC_MODULES = (
    "argparse", "base64", "bisect", "calendar", "collections", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fnmatch", "fractions",
    "functools", "glob", "hashlib", "heapq", "html", "http.client", "inspect", "ipaddress", "json",
    "logging", "operator", "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "socket",
    "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)  # NOTE: no frozen modules (os, io, abc): they have no .py origin to read
CODE_MODULES = ("bisect", "colorsys", "fnmatch", "heapq", "json.decoder", "json.encoder", "shlex", "textwrap")

WRITTEN = """\
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.
Serving a large language model means batching requests, caching keys and values, and streaming tokens back.
Please summarize the following article in three sentences, keeping every number exactly as written.
What is the capital of France? The capital of France is Paris, which sits on the river Seine.
Could you explain why the sky is blue? Sunlight scatters off air molecules, and blue light scatters most.
I'm not sure that's right; let's check the documentation before we change anything in production.
She said, "We'll meet at 9:30 a.m. on Monday," but the meeting moved to Tuesday afternoon.
Mixture-of-experts layers route each token to a few experts, so only a fraction of the weights is used.
Multi-head latent attention compresses keys and values into a small latent vector per token.
Error: connection refused (errno 111). Retrying in 5 seconds... attempt 3 of 10.
Step 1: preheat the oven to 180 °C. Step 2: mix flour, sugar and eggs. Step 3: bake for 25 minutes.
Dear team, thank you for your patience during the migration; the new cluster is now online.
In 1969, Apollo 11 landed on the Moon; Neil Armstrong and Buzz Aldrin walked on the surface.
The function returns None when the key is missing, otherwise it returns the cached value.
Think step by step, then give the final answer on its own line after "Answer:".
The user asked for the weather in Tokyo, so the assistant called the get_weather tool.
人工智能正在改变我们的生活方式，大型语言模型可以回答问题、写代码和翻译文本。
今天天气很好，我们去公园散步吧。北京是中国的首都，上海是最大的城市。
请用中文回答下面的问题：为什么天空是蓝色的？因为空气分子对蓝光的散射更强。
深度学习模型的训练需要大量的数据和计算资源，推理阶段则更关注延迟和吞吐量。
这个函数的时间复杂度是多少？请一步一步地思考，然后给出最终答案。
混合专家模型把每个词元路由到少数几个专家，从而降低计算量。
東京は日本の首都です。今日はとても良い天気ですね。ありがとうございます。
機械学習のモデルを使って、文章を要約したり翻訳したりできます。
안녕하세요, 만나서 반갑습니다. 오늘 날씨가 정말 좋네요.
Привет, как дела? Сегодня хорошая погода, и мы идём гулять.
Grüße aus München! Ça va très bien, merci. ¿Dónde está la estación? Ñandú, café, naïve, façade.
Emoji test: 😀 😂 🚀 🎉 👍 ❤️ 🔥 ✅ 🤖 🌍 👨‍👩‍👧‍👦 🇯🇵 — done.
Math: α + β = γ, ∑ x_i², ∫ f(x) dx, √2 ≈ 1.41421356, π ≈ 3.14159, e^(iπ) + 1 = 0, 3 × 4 ÷ 2 ≤ 6.
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
class Cache:
    def __init__(self, capacity: int = 128) -> None:
        self.items: dict[str, bytes] = {}
        self.capacity = capacity
if __name__ == "__main__":
    print(f"result = {fibonacci(10)!r}")
function debounce(fn, wait = 100) {
  let timer = null;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), wait); };
}
const response = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(payload) });
#include <stdio.h>
int main(int argc, char **argv) { for (int i = 0; i < argc; ++i) printf("%s\\n", argv[i]); return 0; }
fn main() { let v: Vec<u32> = (1..=10).map(|x| x * x).collect(); println!("{:?}", v); }
SELECT name, COUNT(*) AS n FROM orders WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY n DESC;
$ pip install -e ".[test]" && python -m pytest -q tests/ --maxfail=1
$ curl -s http://localhost:30000/v1/models | jq '.data[0].id'
# Heading
- item one
- item **two** with `inline code`
> a quoted line, and a [link](https://example.com/docs?page=2&lang=en).
```json
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
```
<html><body><div class="main" id="app">Hello, world!</div></body></html>
"""

_WORDS = ("alpha", "beta", "gamma", "delta", "request", "token", "expert", "layer", "cache", "batch",
          "server", "client", "model", "weight", "prompt", "answer", "城市", "模型", "数据", "東京")


def _stdlib_source(name: str) -> str | None:
    # read from the file, never from live objects: other libraries (torch, ...) patch stdlib functions
    # at import time, and the corpus must not depend on what the process imported before
    spec = importlib.util.find_spec(name)
    origin = Path(spec.origin) if spec and spec.origin else None
    return origin.read_text(encoding="utf-8") if origin and origin.suffix == ".py" else None


def _docstrings() -> Iterator[str]:
    seen: set[str] = set()
    for name in DOC_MODULES:
        source = _stdlib_source(name)
        if source is None:  # a Python installed without .py sources: the rest of the corpus still trains
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and doc not in seen:
                    seen.add(doc)
                    yield doc


def _sources() -> Iterator[str]:
    return (s for s in map(_stdlib_source, CODE_MODULES) if s is not None)


def _generated(n: int = 600) -> Iterator[str]:
    """Numbers, dates, arithmetic and JSON from integer formulas (deterministic on every Python)."""
    for i in range(n):
        a, b = (i * 7919 + 13) % 100_000, (i * 104_729 + 7) % 10_000
        word = _WORDS[i % len(_WORDS)]
        yield f"{a} + {b} = {a + b}; {a} * {b % 97} = {a * (b % 97)}; {a / (b + 1):.4f}; {a:#x}; {b:.2e}"
        yield f"2024-{i % 12 + 1:02d}-{i % 28 + 1:02d}T{i % 24:02d}:{i % 60:02d}:{(i * 7) % 60:02d}Z {word} #{i}"
        record: dict[str, Any] = {"id": i, "name": f"{word}_{i % 37}", "score": round(a / 997, 3),
                                  "tags": [_WORDS[(i + k) % len(_WORDS)] for k in range(i % 4)],
                                  "active": i % 3 == 0, "parent": None if i % 5 else i // 5}
        yield json.dumps(record, ensure_ascii=False, indent=2 if i % 4 == 0 else None)


def build_corpus() -> list[str]:
    """The training corpus: stdlib docstrings and sources, the written samples above, generated data."""
    return [*_docstrings(), *_sources(), *WRITTEN.splitlines(), *_generated()]


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # digits in groups of at most 3, then GPT-2 style byte-level splitting of words / spaces / punctuation
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(r"\p{N}{1,3}", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _bos_post_processor() -> dict[str, Any]:
    bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [SPECIAL_TOKENS.index(BOS)], "tokens": [BOS]}},
    }


def _finish_tokenizer_json(tok: Tokenizer) -> dict[str, Any]:
    """Mark only bos/eos/pad as special (skipped on decode) and make the backend add BOS (as HF expects)."""
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] in SKIPPED_TOKENS
    data["post_processor"] = _bos_post_processor()
    return data


def tokenizer_config(model_max_length: int = DEFAULT_MAX_LENGTH) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": default_chat_template(),
    }


def train_tokenizer(out_dir: str | Path, vocab_size: int = 4096, *,
                    model_max_length: int = DEFAULT_MAX_LENGTH, corpus: Iterable[str] | None = None) -> int:
    """Train a byte-level BPE tokenizer; write `tokenizer.json` and `tokenizer_config.json` to `out_dir`.

    `corpus` defaults to `build_corpus()`. Deterministic: the same `vocab_size` and corpus (on the same Python)
    give byte-identical files. Returns the final vocabulary size (special tokens included), at most `vocab_size`.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB} (16 special tokens + 256 bytes), got {vocab_size}")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, max_token_length=16,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(build_corpus() if corpus is None else corpus, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "tokenizer.json", _finish_tokenizer_json(tok))
    _write_json(out / "tokenizer_config.json", tokenizer_config(model_max_length))
    return tok.get_vocab_size(with_added_tokens=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlaserve.tools.tokenizer", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--model-max-length", type=int, default=DEFAULT_MAX_LENGTH)
    args = ap.parse_args(argv)
    n = train_tokenizer(args.out, args.vocab_size, model_max_length=args.model_max_length)
    print(f"wrote {args.out}/tokenizer.json ({n} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
