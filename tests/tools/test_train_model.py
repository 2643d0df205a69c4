"""The training model (tools/train_model.py) computes what the serving model and HF compute, on its own export."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from seq_runner import SeqRunner

from mlaserve.config import ModelConfig
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_weights
from mlaserve.tools.train_demo import demo_config
from mlaserve.tools.train_model import DemoTrainModel, checkpoint_state

transformers = pytest.importorskip("transformers")


def _random_trained(vocab: int = 512, seed: int = 0) -> DemoTrainModel:
    """A tiny model with every tensor away from its initial value (norms, router bias included)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_dict(demo_config(vocab, tiny=True))
    model = DemoTrainModel(cfg, 256).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() < 2 else 0.05))
        for gate in model.gates():
            gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def _export(model: DemoTrainModel, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_state(model), str(path / "model.safetensors"))
    cfg = demo_config(model.cfg.vocab_size, tiny=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_export_loads_and_matches_serving_and_hf_fp32(tmp_path, one_thread):
    """Logits of the training model (fp32) = mlaserve's (fp32 prefill) = HF DeepseekV3ForCausalLM's; the MTP
    head's logits = the serving NextN layer's on the same inputs."""
    model = _random_trained().float()
    # the export is bf16: compare against the training model holding the same rounded weights
    path = _export(model, tmp_path / "ckpt")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    cfg = ModelConfig.from_hf(path)
    ids = torch.randint(2, cfg.vocab_size, (1, 26))
    with torch.no_grad():
        out = model(ids)
    ours = DeepseekForCausalLM(cfg, dtype=torch.float32, load_mtp=True)
    load_weights(ours, cfg, path, progress=False)
    runner = SeqRunner(ours, cfg)
    main = runner.extend({0: ids[0, :24].tolist()}, all_logits=True)
    tol = 1e-4 * out.logits.abs().max()
    assert (main.logits - out.logits[0]).abs().max() <= tol

    draft = runner.mtp_logits(ids[0, 1:25], main.hidden)
    assert (draft - out.mtp_logits[0]).abs().max() <= 1e-4 * out.mtp_logits.abs().max()

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(ids[:, :24]).logits[0]
    assert (hf_logits - out.logits[0]).abs().max() <= tol


def test_gate_bias_update_moves_toward_balance():
    """Aux-loss-free balancing: over-loaded experts' bias goes down, under-loaded ones' up, by the speed."""
    model = _random_trained().train()
    gate = model.gates()[0]
    gate.load.copy_(torch.arange(gate.load.numel(), dtype=torch.float32))
    before = gate.e_score_correction_bias.clone()
    gate.update_bias(0.01)
    step = gate.e_score_correction_bias - before
    n = step.numel()
    assert torch.allclose(step[: n // 2], torch.full((n // 2,), 0.01))
    assert torch.allclose(step[n // 2:], torch.full((n - n // 2,), -0.01))
    assert not gate.load.any()
