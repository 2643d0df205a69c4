"""Weight loading: original names through the index, clear one-line errors, dummy weights, w_kc / w_vc, the MTP layer
from a separate draft checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve.config import ModelConfig
from mlaserve.distributed import TensorParallel
from mlaserve.distributed.expert import ExpertParallel
from mlaserve.draft_checkpoint import DraftCheckpoint, draft_checkpoint
from mlaserve.kernels.quant import block_dequant_ref
from mlaserve.models import weights as weights_mod
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import CheckpointError, load_token_map, load_weights
from mlaserve.tools.export_nextn import export_nextn


def build(path, **kw):
    cfg = ModelConfig.from_hf(path)
    return DeepseekForCausalLM(cfg, dtype=torch.float32, **kw), cfg


def corrupt(src, dst, edit):
    """Copy a checkpoint and apply `edit(tensors)` to its first shard."""
    shutil.copytree(src, dst)
    return corrupt_in_place(dst, edit)


def corrupt_in_place(dst, edit):
    shard = sorted(dst.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, str(shard))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != shard.name}
    for k in tensors:
        index["weight_map"][k] = shard.name
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_missing_tensor_is_named(checkpoints, tmp_path):
    bad = corrupt(checkpoints("v2-lite"), tmp_path / "bad", lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight"))
    model, cfg = build(bad)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.self_attn\.kv_b_proj\.weight' "
                                              r"\(expected shape \[256, 64\]\)"):
        load_weights(model, cfg, bad, progress=False)


def test_misshaped_tensor_is_named(checkpoints, tmp_path):
    def edit(t):
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:, :100].contiguous()
    bad = corrupt(checkpoints("v2-lite"), tmp_path / "bad", edit)
    model, cfg = build(bad)
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight: shape \[4096, 100\], expected \[4096, 256\]"):
        load_weights(model, cfg, bad, progress=False)


def test_unexpected_tensor_is_named(checkpoints, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(4, 4)
    bad = corrupt(checkpoints("v2-lite"), tmp_path / "bad", edit)
    model, cfg = build(bad)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.0\.gate_proj"):
        load_weights(model, cfg, bad, progress=False)


def test_dummy_weights_equal_make_checkpoint_with_same_seed(checkpoints):
    path = checkpoints("v3")
    a, cfg = build(path, load_mtp=True)
    b, _ = build(path, load_mtp=True)
    load_weights(a, cfg, path, progress=False)
    load_weights(b, cfg, None, load_format="dummy", seed=0, progress=False)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_fp8_weights_kept_or_dequantised(checkpoints):
    path = checkpoints("v3-fp8")
    fp8, cfg = build(path)
    load_weights(fp8, cfg, path, progress=False)
    deq, _ = build(path, dequant_fp8=True)
    load_weights(deq, cfg, path, dequant_fp8=True, progress=False)
    attn8, attn = fp8.model.layers[1].self_attn, deq.model.layers[1].self_attn
    # q_a_proj rides in the merged qkv_a_proj where its rows fill whole FP8 blocks (always, dequantised)
    q8 = attn8.qkv_a_proj if attn8.qkv_a_proj is not None else attn8.q_a_proj
    assert q8.weight.dtype == torch.float8_e4m3fn and attn.qkv_a_proj.weight.dtype == torch.float32
    want = block_dequant_ref(q8.weight, q8.weight_scale_inv, (128, 128), torch.float32)
    assert torch.equal(attn.qkv_a_proj.weight[: want.shape[0]], want)
    e8, e = fp8.model.layers[1].mlp.experts, deq.model.layers[1].mlp.experts
    assert torch.equal(e.w2[3], block_dequant_ref(e8.w2[3], e8.w2_scale[3], (128, 128), torch.float32))
    # absorbed weights come from the dequantised kv_b_proj in both models
    assert torch.equal(attn8.w_kc, attn.w_kc) and torch.equal(attn8.w_vc, attn.w_vc)


def test_absorbed_weights_are_kv_b_proj_slices(checkpoints):
    path = checkpoints("v2")
    model, cfg = build(path)
    load_weights(model, cfg, path, progress=False)
    attn = model.model.layers[2].self_attn
    w = attn.kv_b_proj.weight.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
    assert torch.equal(attn.w_kc, w[:, : cfg.qk_nope_head_dim]) and torch.equal(attn.w_vc, w[:, cfg.qk_nope_head_dim:])


def test_load_token_map_formats_and_one_line_errors(tmp_path):
    torch.save(torch.tensor([7, 3, 3, 9], dtype=torch.int32), tmp_path / "a.pt")
    torch.save([5, 1], tmp_path / "b.pt")
    (tmp_path / "c.json").write_text("[4, 2, 8]")
    assert load_token_map(tmp_path / "a.pt", 10).tolist() == [3, 7, 9]        # sorted, unique, int64
    assert load_token_map(tmp_path / "b.pt", 10).tolist() == [1, 5]
    assert load_token_map(tmp_path / "c.json", 10).dtype == torch.int64
    torch.save(torch.tensor([0.5, 1.0]), tmp_path / "f.pt")
    torch.save(torch.zeros(2, 2, dtype=torch.int64), tmp_path / "g.pt")
    (tmp_path / "h.json").write_text("{not json")
    (tmp_path / "i.pt").write_bytes(b"garbage")
    (tmp_path / "e.json").write_text("[]")
    cases = {"a.pt": "token ids must be in [0, 5) for this checkpoint; the file has 3 .. 9",
             "f.pt": "expected a non-empty 1-D list of integer token ids", "g.pt": "(2, 2)",
             "h.json": "cannot read token ids", "i.pt": "cannot read token ids", "e.json": "non-empty"}
    for name, words in cases.items():
        with pytest.raises(ValueError) as e:
            load_token_map(tmp_path / name, 5 if name == "a.pt" else 10)
        assert words in str(e.value) and str(e.value).startswith("--speculative-token-map ") \
            and "\n" not in str(e.value), str(e.value)


def nextn_draft(src, dst, keep: bool) -> DraftCheckpoint:
    export_nextn(src, dst, keep)
    return draft_checkpoint(str(dst), str(src), ModelConfig.from_hf(src))


@pytest.mark.parametrize("keep", [False, True], ids=["without-embed-head", "with-embed-head"])
def test_nextn_draft_loads_as_the_own_mtp_layer_on_each_tp_ep_rank(checkpoints, tmp_path, monkeypatch, keep):
    """Each rank of tp 2 / ep 2 (FP8, dequantised: the shrunk experts' shards are not whole 128-blocks): the MTP
    layer from a NextN export equals the one the target's own tensors give (the head: the export's copy, or lm_head's
    weight when left out); the draft's other rank's experts and the target's own MTP tensors are not read."""
    path = checkpoints("v3-fp8")
    cfg, draft = ModelConfig.from_hf(path), nextn_draft(path, tmp_path / "nextn", keep)
    read: list[str] = []
    real = weights_mod.iter_safetensors

    def spy(p, skip=None):
        n, items = real(p, skip)
        return n, ((read.append(f"{p}:{name}"), (name, t))[1] for name, t in items)
    monkeypatch.setattr(weights_mod, "iter_safetensors", spy)
    for rank in range(2):
        kw = dict(load_mtp=True, dequant_fp8=True, tp=TensorParallel(rank, 2), ep=ExpertParallel(rank, 2))
        own, _ = build(path, **kw)
        load_weights(own, cfg, path, progress=False, dequant_fp8=True)
        read.clear()
        got, _ = build(path, **kw)
        load_weights(got, cfg, path, progress=False, dequant_fp8=True, draft=draft)
        from_target = [n.split(":")[1] for n in read if n.startswith(f"{path}:")]
        from_draft = [n.split(":")[1] for n in read if n.startswith(f"{draft.path}:")]
        assert from_draft and not any(n.startswith("model.layers.3.") for n in from_target)
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in from_draft if ".experts." in n}
        half = cfg.n_routed_experts // 2
        assert experts == set(range(half * rank, half * (rank + 1)))
        mtp = got.mtp
        assert (mtp.shared_head.head.weight is got.lm_head.weight) is not keep
        if not keep:
            mtp.shared_head.head.weight = own.mtp.shared_head.head.weight = got.lm_head.weight
        for (name, a), (_, b) in zip(own.state_dict().items(), got.state_dict().items()):
            assert torch.equal(a, b), name


def test_draft_tensors_named_as_in_the_draft_checkpoint(checkpoints, tmp_path):
    path = checkpoints("v3")
    cfg = ModelConfig.from_hf(path)
    cases = [(lambda t: t.pop("model.layers.0.eh_proj.weight"), r"missing tensor 'model\.layers\.0\.eh_proj\.weight' "
              r"of the draft checkpoint .*nextn0 \(expected shape \[256, 512\]\)"),
             (lambda t: t.update({"model.layers.1.enorm.weight": torch.zeros(256)}),
              r"unexpected tensor 'model\.layers\.1\.enorm\.weight' in the NextN draft checkpoint .*nextn1 \(it "
              r"holds model\.layers\.0\.\* only\)"),
             (lambda t: t.update({"model.layers.0.enorm.weight": torch.zeros(3)}),
              r"model\.layers\.0\.enorm\.weight of the draft checkpoint .*nextn2: shape \[3\], expected \[256\]")]
    for i, (edit, words) in enumerate(cases):
        draft = nextn_draft(path, tmp_path / f"nextn{i}", keep=False)
        corrupt_in_place(Path(draft.path), edit)
        model, _ = build(path, load_mtp=True)
        with pytest.raises(CheckpointError, match=words) as e:
            load_weights(model, cfg, path, progress=False, draft=draft)
        assert "\n" not in str(e.value)
