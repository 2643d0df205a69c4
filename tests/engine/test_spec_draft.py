"""--speculative-draft-model-path in the scheduler on the CPU (fp32): the demo model's MTP layer exported in SGLang's
NextN format (`mlaserve export-nextn`, with and without its embedding / head copies) or read from another full
checkpoint drafts exactly as the target's own layer (the same tokens and accept lengths, those of decoding without
speculation), for the demo target and for a copy of it without an MTP layer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from mlaserve.config import ConfigError
from mlaserve.tools.export_nextn import export_nextn
from test_spec import DEMO, accept_length, assert_no_leak, demo_prompts, make, msg, spec  # noqa: F401
from seq_runner import drive_scheduler as run

MTP = "model.layers.5."                     # the demo model's MTP layer (num_hidden_layers 5)


@pytest.fixture(scope="module")
def nextn(tmp_path_factory) -> dict[bool, str]:
    """keep_embed_and_head -> the demo's NextN export."""
    root, out = tmp_path_factory.mktemp("nextn"), {}
    for keep in (False, True):
        export_nextn(Path(DEMO), root / str(keep), keep)
        out[keep] = str(root / str(keep))
    return out


@pytest.fixture(scope="module")
def no_mtp(tmp_path_factory) -> str:
    """The demo model without its MTP layer: num_nextn_predict_layers 0, no model.layers.5.* tensors."""
    src, dst = Path(DEMO), tmp_path_factory.mktemp("nomtp")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(MTP)}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            save_file({k: h.get_tensor(k) for k in h.keys() if not k.startswith(MTP)}, str(dst / f.name))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((src / "config.json").read_text()) | {"num_nextn_predict_layers": 0}
    (dst / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return str(dst)


@pytest.fixture(scope="module")
def reference(demo_prompts) -> tuple[list, dict, float]:
    """Requests, their tokens without speculation, and the accept length of the demo's own MTP layer on them."""
    msgs = [msg(f"d{i}", p, max_new=24) for i, p in enumerate(demo_prompts[:4])]
    base, own = run(make(DEMO), msgs), spec(DEMO)
    got = run(own, msgs)
    assert {r: o["ids"] for r, o in got.items()} == {r: o["ids"] for r, o in base.items()}
    return msgs, base, accept_length(own)


def check_like_own_mtp(sched, reference) -> None:
    msgs, base, own_accept = reference
    got = run(sched, msgs)
    assert {r: o["ids"] for r, o in got.items()} == {r: o["ids"] for r, o in base.items()}
    assert accept_length(sched) == own_accept > 2.0              # the same weights draft the same tokens
    assert_no_leak(sched)


@pytest.mark.parametrize("keep", [False, True], ids=["without-embed-head", "with-embed-head"])
def test_nextn_export_drafts_as_the_own_mtp_layer(nextn, reference, keep):
    s = spec(DEMO, speculative_draft_model_path=nextn[keep])
    model = s.runner.model
    assert (model.mtp.shared_head.head.weight is model.lm_head.weight) is not keep   # left out: lm_head's weight
    check_like_own_mtp(s, reference)


@pytest.mark.parametrize("draft", ["nextn", "full"])
def test_target_without_mtp_layer_drafts_with_a_separate_checkpoint(nextn, no_mtp, reference, draft):
    with pytest.raises(ConfigError, match="no MTP"):
        spec(no_mtp)
    s = spec(no_mtp, speculative_draft_model_path=nextn[False] if draft == "nextn" else DEMO)
    check_like_own_mtp(s, reference)


def test_dummy_weights_with_a_draft_checkpoint(nextn, no_mtp, tmp_path):
    """--load-format dummy: random weights for every layer, the MTP layer's too; the draft's config still checked."""
    s = spec(no_mtp, speculative_draft_model_path=nextn[True], load_format="dummy")
    assert s.runner.model.mtp is not None
    run(s, [msg("x", [5, 6, 7], max_new=6)])
    assert_no_leak(s)
    cfg = json.loads((Path(nextn[True]) / "config.json").read_text()) | {"hidden_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size is 512 in its config.json and 256 in the target's"):
        spec(no_mtp, speculative_draft_model_path=str(tmp_path), load_format="dummy")
