"""train-demo end to end at CPU size, and the corpus split it trains on (pip held out)."""
from __future__ import annotations

import json
import math

import torch

from mlaserve.cli import main as cli
from mlaserve.config import ModelConfig
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_weights
from mlaserve.tokenizer import load_tokenizer
from mlaserve.tools import corpus


def test_training_corpus_never_holds_pip():
    held = corpus.heldout_dir()
    files = corpus.training_files()
    assert held.name == "pip" and corpus.heldout_files()
    assert files and not [f for f in files if f.is_relative_to(held)]
    assert any(f.name == "json" or f.parent.name == "json" for f in files)     # the stdlib is in


def test_train_demo_tiny_writes_a_checkpoint_both_heads_learn(tmp_path, one_thread):
    out = tmp_path / "demo"
    rc = cli(["train-demo", "--out", str(out), "--tiny", "--device", "cpu", "--max-corpus-mb", "0.5",
              "--tokenizer-sample-mb", "0.25", "--vocab-size", "600", "--steps", "40", "--log-every", "10",
              "--seq-len", "32", "--batch-size", "8", "--lr", "1e-2", "--warmup", "5", "--eval-windows", "2"])
    assert rc == 0
    log = json.loads((out / "train_log.json").read_text())
    curve = log["curve"]
    assert [p["step"] for p in curve] == [10, 20, 30, 40]
    # both heads learn: well under the loss of a uniform guess over the 600 ids (ln 600 = 6.40 nats) after 40 steps
    # (the drop from step 10 varies with the machine's corpus sample: 0.16 nats in one CI run)
    uniform = math.log(600)
    assert curve[-1]["loss"] < uniform - 0.5 and curve[-1]["mtp_loss"] < uniform - 0.5, curve
    assert 0 < log["heldout"]["bits_per_byte"] < 8
    cfg = ModelConfig.from_hf(out)
    assert cfg.vocab_size == load_tokenizer(out).vocab_size
    assert cfg.topk_method == "noaux_tc" and cfg.q_lora_rank and cfg.rope_scaling and cfg.num_nextn_predict_layers
    model = DeepseekForCausalLM(cfg, dtype=torch.float32, load_mtp=True)
    load_weights(model, cfg, out, progress=False)      # every tensor checked against checkpoint_specs
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0                        # moved by the aux-loss-free balancing


def test_fixed_steps_schedule_equals_the_clock_derived_one():
    """`--steps N` gives the same lr at every step as a `--train-seconds` run whose clock chose N steps: the probe
    fixes the step count at step 40, inside the warm-up, where the lr does not depend on the step count. The shipped
    model's logged lr curve (a clock run that chose 1,863 steps) is the fixed-step schedule of 1,863 steps."""
    from pathlib import Path

    from mlaserve.tools.train_demo import PROBE_TO, lr_at, parse_args

    args = parse_args(["--out", "x"])
    assert PROBE_TO < args.warmup
    assert all(lr_at(s, 10**9, args.lr, args.warmup) == lr_at(s, 1863, args.lr, args.warmup) for s in range(PROBE_TO))
    shipped = Path(__file__).parents[2] / "benchmarks" / "results" / "demo-model" / "train_log.json"
    log = json.loads(shipped.read_text())
    assert log["steps"] == 1863 and log["args"]["lr"] == args.lr and log["args"]["warmup"] == args.warmup
    for p in log["curve"]:
        assert math.isclose(p["lr"], lr_at(p["step"] - 1, 1863, args.lr, args.warmup), rel_tol=1e-12), p
