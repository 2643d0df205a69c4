"""`mlaserve bench one-batch` on the CPU: one process, two tensor-parallel ranks and two TP + EP ranks in one run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlaserve
from mlaserve.bench import one_batch
from mlaserve.bench.floor import decode_step_bytes
from mlaserve.config import ModelConfig
from mlaserve.tools.make_checkpoint import make_config

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"


def test_tp_and_ep_sizes_in_one_run(tmp_path, capsys):
    cfg = make_config(json.loads((CONFIGS / "deepseek-v2-lite.json").read_text()), num_layers=2, shrink=True, fp8=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "rows.md"
    assert one_batch.main(["--load-format", "dummy", "--model-config", str(tmp_path / "config.json"), "--batch-size",
                           "2", "--input-len", "12", "--output-len", "3", "--tp-size", "1", "2", "--ep-size", "1",
                           "2", "--device", "cpu", "--output-file", str(out)]) == 0
    text = out.read_text()
    rows = json.loads(text.split("<!-- rows: ")[1].split(" -->")[0])
    assert [r.get("engine", "mlaserve") for r in rows] == ["mlaserve", "mlaserve tp 2", "mlaserve tp 2 ep 2"]
    assert rows[1]["allreduce_s"] > 0 and "| mlaserve tp 2 | 2 | 12 | 3 |" in text
    assert "skipping --tp-size 1 --ep-size 2" in capsys.readouterr().out


def test_floor_of_one_rank_splits_all_but_the_replicated_parts():
    v3 = ModelConfig.from_dict(json.loads((CONFIGS / "deepseek-v3.json").read_text()))
    one, two = decode_step_bytes(v3, 1, 256), decode_step_bytes(v3, 1, 256, tp=2)
    assert two["kv_cache"] == one["kv_cache"]                           # the latent cache is on every rank
    assert two["lm_head"] == one["lm_head"] / 2 and one["attention"] / 2 < two["attention"] < one["attention"]
    assert two["moe"] < one["moe"]


@pytest.mark.parametrize("topk,n", [(1, 3), (3, 5)])
def test_speculative_rows_report_accept_length(tmp_path, topk, n):
    """The demo model (its MTP head drafts) decoding speculatively until every request has --output-len tokens,
    with a chain and with a tree: the rows carry the accept length."""
    from mlaserve.demo import DEMO_DIR

    out = tmp_path / "rows.md"
    assert one_batch.main(["--model-path", str(DEMO_DIR), "--batch-size", "1", "3", "--input-len", "16",
                           "--output-len", "20", "--device", "cpu", "--speculative-algorithm", "EAGLE",
                           "--speculative-num-steps", "2", "--speculative-eagle-topk", str(topk),
                           "--speculative-num-draft-tokens", str(n), "--output-file", str(out)]) == 0
    text = out.read_text()
    rows = json.loads(text.split("<!-- rows: ")[1].split(" -->")[0])
    assert [r["engine"] for r in rows] == [f"mlaserve spec (2, {topk}, {n})"] * 2
    assert all(1.0 <= r["accept_length"] <= 3.0 and r["decode_tok_s"] > 0 for r in rows)
    assert f"mlaserve spec (2, {topk}, {n}), accept " in text
