"""The shipped demo model: HF transformers and mlaserve give the same greedy tokens in fp32."""
from __future__ import annotations

import pytest
import torch
from seq_runner import SeqRunner

from mlaserve.config import ModelConfig
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_weights
from mlaserve.demo import DEMO_DIR
from mlaserve.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

PROMPTS = ("def is_url(name: str) -> bool:", "class Link:\n    def __init__(self, url")
NEW_TOKENS = 16


def test_greedy_tokens_match_hf_fp32(one_thread):
    path = DEMO_DIR
    cfg = ModelConfig.from_hf(path)
    tok = load_tokenizer(path)
    assert cfg.vocab_size == tok.vocab_size
    ours = DeepseekForCausalLM(cfg, dtype=torch.float32)
    load_weights(ours, cfg, path, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tok.encode(p) for p in PROMPTS]
    runner = SeqRunner(ours, cfg)
    nxt = runner.extend(dict(enumerate(prompts))).logits.argmax(-1)
    got = [[int(t)] for t in nxt]
    for _ in range(NEW_TOKENS - 1):
        nxt = runner.decode({i: g[-1] for i, g in enumerate(got)}).logits.argmax(-1)
        for g, t in zip(got, nxt):
            g.append(int(t))
    for p, g in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2,
                               eos_token_id=None)[0, len(p):]
        assert g == want.tolist(), (tok.decode(g), tok.decode(want.tolist()))
    assert "return" in tok.decode(got[0]) or ":" in tok.decode(got[0])    # it writes a body, not noise
