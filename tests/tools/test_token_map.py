"""`mlaserve token-map`: counts a corpus with the checkpoint's tokenizer and keeps the most frequent ids."""
from __future__ import annotations

import json

import pytest
import torch

from mlaserve.demo import DEMO_DIR
from mlaserve.models.weights import load_token_map
from mlaserve.tokenizer import load_tokenizer
from mlaserve.tools.token_map import count_tokens, main, top_ids


def test_top_ids_by_count_then_lower_id():
    counts = torch.tensor([5, 0, 9, 5, 1, 5]).numpy()
    assert top_ids(counts, 3).tolist() == [0, 2, 3]          # 9, then the first two of the 5s, sorted by id


def test_cli_writes_a_map_the_server_loads(tmp_path, capsys):
    corpus = tmp_path / "src"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    (corpus / "b.py").write_text("class Stack:\n    def push(self, item):\n        self.items.append(item)\n")
    (corpus / "skip.txt").write_text("zebra quagga okapi " * 50)
    for out in (tmp_path / "map.pt", tmp_path / "map.json"):
        assert main(["--model-path", str(DEMO_DIR), "--corpus", str(corpus), "--glob", "*.py", "--size", "16",
                     "--out", str(out)]) == 0
    ids = load_token_map(tmp_path / "map.pt", 8192)
    assert len(ids) == 16 and ids.tolist() == json.loads((tmp_path / "map.json").read_text())
    tok = load_tokenizer(DEMO_DIR)
    counts = count_tokens(tok.backend, [(corpus / "a.py").read_text(), (corpus / "b.py").read_text()], 8192)
    assert ids.tolist() == top_ids(counts, 16).tolist()
    assert "16 of 8192 token ids" in capsys.readouterr().err


@pytest.mark.parametrize("args,words", [(["--size", "0"], "--size 0"), (["--out", "x.bin"], "x.bin"),
                                        (["--corpus", "/nonexistent"], "no such file")])
def test_cli_errors(tmp_path, capsys, args, words):
    base = {"--corpus": str(tmp_path), "--size": "8", "--out": str(tmp_path / "m.pt")}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    with pytest.raises(SystemExit):
        main(["--model-path", str(DEMO_DIR)] + [x for kv in base.items() for x in kv])
    assert words in capsys.readouterr().err
