"""`mlaserve export-nextn`: a block-FP8 checkpoint's MTP layer written in the NextN format (names, values, config,
index, copied files), with and without the embedding / head copies; one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mlaserve
from mlaserve.cli import main as cli
from mlaserve.config import ModelConfig
from mlaserve.models.weights import checkpoint_specs
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A 2-layer V3-shape FP8 checkpoint (MTP layer 2, MoE) with a tokenizer file beside it."""
    d = json.loads((CONFIGS / "deepseek-v3.json").read_text()) | {"first_k_dense_replace": 1}
    path = write_checkpoint(make_config(d, num_layers=2, shrink=True, fp8=True), tmp_path_factory.mktemp("src") / "m",
                            progress=False, tokenizer=False)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    return path


def tensors(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in set(index.values()):
        with safe_open(str(path / file), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    assert set(out) == set(index)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("keep", [False, True], ids=["without-embed-head", "with-embed-head"])
def test_export_writes_the_mtp_layer_as_layer_0(source, tmp_path, keep, capsys):
    out = tmp_path / "nextn"
    assert cli(["export-nextn", "--input-dir", str(source), "--output-dir", str(out)]
               + (["--keep-embed-and-head"] if keep else [])) == 0
    assert "tensors of the MTP layer" in capsys.readouterr().err
    src_cfg = json.loads((source / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == src_cfg | {"num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"]}
    assert (out / "tokenizer_config.json").read_text() == (source / "tokenizer_config.json").read_text()
    assert [f.name for f in out.glob("*.safetensors")] == ["nextn_layer_parameters.safetensors"]
    got, want = tensors(out), tensors(source)
    specs = [s.name for s in checkpoint_specs(ModelConfig.from_dict(src_cfg)) if s.name.startswith("model.layers.2.")]
    names = {"model.layers.0." + n[len("model.layers.2."):] for n in specs}
    dropped = {"model.layers.0.embed_tokens.weight", "model.layers.0.shared_head.head.weight"}
    assert set(got) == (names if keep else names - dropped)
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" in got
    assert "model.layers.0.mlp.experts.15.down_proj.weight_scale_inv" in got and "model.layers.0.enorm.weight" in got
    for name, t in got.items():
        ref = want["model.layers.2." + name[len("model.layers.0."):]]
        assert t.dtype == ref.dtype and torch.equal(bits(t), bits(ref)), name


def test_export_fails_in_one_line(source, tmp_path, capsys):
    v2 = json.loads((CONFIGS / "deepseek-v2-lite.json").read_text())
    no_mtp = write_checkpoint(make_config(v2, num_layers=2, shrink=True, fp8=False), tmp_path / "v2", progress=False,
                              tokenizer=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in source.iterdir():
        (broken / f.name).symlink_to(f)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.eh_proj.weight"]
    (broken / "model.safetensors.index.json").unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [(no_mtp, tmp_path / "a", "no MTP (NextN) layer to export (num_nextn_predict_layers is 0"),
             (tmp_path / "none", tmp_path / "b", "no config.json"),
             (broken, tmp_path / "c", "missing tensor 'model.layers.2.eh_proj.weight' of the MTP layer"),
             (source, tmp_path / "full", "exists and is not an empty directory")]
    for src, dst, words in cases:
        assert cli(["export-nextn", "--input-dir", str(src), "--output-dir", str(dst)]) == 1
        err = capsys.readouterr().err
        assert words in err and err.startswith("mlaserve export-nextn: ") and err.count("\n") == 1, err
