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


def test_the_seeds_bench_one_batch_flags(tmp_path, capsys, monkeypatch):
    """SGLang's `bench_one_batch --batch-size 1 --input 256 --output 32 --model M --tp 8 --torch-compile-max-bs 1
    --cuda-graph-max-bs 1`: the same meanings here; --trust-remote-code and a refused configuration give one line
    before anything runs."""
    args = one_batch.build_parser().parse_args("--batch-size 1 16 --input 256 --output 32 --model /m --tp 8 "
                                               "--enable-torch-compile --torch-compile-max-bs 1 "
                                               "--cuda-graph-max-bs 8".split())
    assert (args.model_path, args.input_len, args.output_len, args.tp_size) == ("/m", 256, 32, [8])
    cfg = make_config(json.loads((CONFIGS / "deepseek-v2-lite.json").read_text()), num_layers=2, shrink=True, fp8=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from mlaserve.config import ModelConfig as MC
    from mlaserve.config_resolve import DeviceInfo, resolve_config
    h100 = DeviceInfo("cuda", 0, "NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0), triton=True)
    monkeypatch.setattr(one_batch, "resolve_for_device",       # as on a GPU: graphs and compile where asked
                        lambda server, path: resolve_config(server, MC.from_hf(path), h100))
    sched = one_batch.bench_config(args, str(tmp_path), 1, 1).sched
    assert (sched.cuda_graph_max_bs, sched.torch_compile_max_bs) == (8, 1)      # bs 16 runs eagerly
    monkeypatch.undo()
    base = ["--load-format", "dummy", "--model-config", str(tmp_path / "config.json"), "--device", "cpu"]
    for extra, line in ((["--trust-remote-code"], "--trust-remote-code: mlaserve runs no code from the model folder"),
                        (["--tp", "1", "3"], "--tp-size 3: ")):
        with pytest.raises(SystemExit):
            one_batch.main(base + extra)
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"mlaserve bench one-batch: error: {line}")


def test_context_length_sizes_the_runner_as_a_server(tmp_path, capsys):
    """--context-length (SGLang's name): the runner's longest sequence and room for it in the KV pool, as a server's
    (its decode graphs' split counts follow it); shorter than the run's sequences: one line."""
    cfg = make_config(json.loads((CONFIGS / "deepseek-v2-lite.json").read_text()), num_layers=2, shrink=True, fp8=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    base = ["--load-format", "dummy", "--model-config", str(tmp_path / "config.json"), "--device", "cpu",
            "--batch-size", "1", "--input-len", "12", "--output-len", "3"]
    server = one_batch.bench_config(one_batch.build_parser().parse_args(base + ["--context-length", "4096"]),
                                    str(tmp_path), 1, 1)
    assert server.load.context_length == 4096 and server.cache.max_total_tokens >= 4096
    default = one_batch.bench_config(one_batch.build_parser().parse_args(base), str(tmp_path), 1, 1)
    assert default.load.context_length == 12 + 3 + 8
    with pytest.raises(SystemExit):
        one_batch.main(base + ["--context-length", "16"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mlaserve bench one-batch: error: --context-length 16 is shorter than the run's sequences (23 tokens: input "
        "+ output + 8)")


@pytest.mark.parametrize("extra,line", [
    (["--model-path", "/m"], "--model-config: the shapes come from --model-path's config.json"),
    (["--profile-dir", "/tmp/p"], "--profile-dir: acts only with --profile"),
])
def test_bench_flags_that_would_act_on_nothing_fail_in_one_line(extra, line, capsys):
    base = ["--load-format", "dummy", "--model-config", str(CONFIGS / "deepseek-v2-lite.json"), "--device", "cpu"]
    with pytest.raises(SystemExit):
        one_batch.main(base + extra)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"mlaserve bench one-batch: error: {line}")


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


def test_spec_projection_pairs_the_runs_and_projects_from_accept_lengths(tmp_path, capsys):
    """benchmarks/spec_projection.py over a file laid out as gpu_v3_scale.sh writes it (a heading per run: graphs,
    compile, speculative; here the demo model on the CPU): the speculative step against the plain one per batch
    size, and speedups projected from given accept lengths (A x plain / speculative) and per-token acceptances
    (A = 1 + p + p^2 + p^3 for 3 drafts)."""
    import importlib.util

    from mlaserve.demo import DEMO_DIR

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("spec_projection", root / "benchmarks" / "spec_projection.py")
    proj = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proj)
    out = tmp_path / "one_batch.md"
    base = ["--model-path", str(DEMO_DIR), "--batch-size", "1", "2", "--input-len", "16", "--output-len", "8",
            "--device", "cpu", "--output-file", str(out)]
    for heading, extra in (("(CUDA graphs)", []), ("--enable-torch-compile", []),
                           ("--speculative-algorithm EAGLE", ["--speculative-algorithm", "EAGLE"])):
        with open(out, "a") as f:
            f.write(f"## tp 1 {heading}\n")
        assert one_batch.main(base + extra) == 0
    capsys.readouterr()
    rows = proj.read_rows([str(out)])
    matched = proj.pairs(rows)
    assert [(p["batch_size"], s["batch_size"]) for p, s in matched] == [(1, 1), (2, 2)]
    graphs_rows = [r for h, r in rows if "CUDA graphs" in h]                       # not the compile run's rows
    assert len(graphs_rows) == 2 and all(p is r for (p, _), r in zip(matched, graphs_rows))
    assert proj.main([str(out), "--accept", "demo=3.0", "--acceptance", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "projections" in text and "p = 0.50: A = 1.88" in text                      # 1 + .5 + .25 + .125
    for (plain, sp), line in zip(matched, [ln for ln in text.splitlines() if ln.startswith("| 1 ") or
                                           ln.startswith("| 2 ")]):
        ratio = sp["decode_step_s"] / plain["decode_step_s"]
        assert line.endswith(f"| {3.0 / ratio:.2f}x | {1.875 / ratio:.2f}x |"), line
    (tmp_path / "none.md").write_text("## tp 1 (CUDA graphs)\n")
    assert proj.main([str(tmp_path / "none.md")]) == 2                              # nothing to pair: one line


def test_speculative_batch_keeps_stepping_requests_that_are_done(tmp_path):
    """bs 4 after bs 1 (the demo model, 3 drafts): requests that have their tokens keep stepping until the last
    one does, their KV following the device's accepted lengths. Their table rows ran out of columns before (an
    IndexError in the fourth request's step, 2026-11-27): rows now have room for (steps + 1) tokens a step."""
    from mlaserve.demo import DEMO_DIR

    out = tmp_path / "rows.md"
    assert one_batch.main(["--model-path", str(DEMO_DIR), "--batch-size", "1", "4", "--input-len", "16",
                           "--output-len", "16", "--device", "cpu", "--speculative-algorithm", "EAGLE",
                           "--output-file", str(out)]) == 0
    rows = json.loads(out.read_text().split("<!-- rows: ")[1].split(" -->")[0])
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert all(1.0 <= r["accept_length"] <= 4.0 for r in rows), rows


def test_profile_writes_the_trace_and_takes_graph_stats_outside_it(tmp_path, monkeypatch):
    """--profile profiles the last batch size's run; the graph's replay time and kernel count use the torch profiler
    too, and a profiler nested in another stops it (on the GPU: "Can't disable Kineto profiler when it's not
    running"), so they are taken after it."""
    import torch

    cfg = make_config(json.loads((CONFIGS / "deepseek-v2-lite.json").read_text()), num_layers=2, shrink=True, fp8=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    seen = []
    monkeypatch.setattr(one_batch, "graph_stats_of", lambda runner, bs, seq_len: seen.append(
        (bs, torch.autograd.profiler._is_profiler_enabled)) or {"graph_replay_s": None, "kernels_per_step": None})
    prof = tmp_path / "prof"
    assert one_batch.main(["--load-format", "dummy", "--model-config", str(tmp_path / "config.json"), "--batch-size",
                           "1", "2", "--input-len", "8", "--output-len", "2", "--device", "cpu", "--profile",
                           "--profile-dir", str(prof), "--output-file", str(tmp_path / "rows.md")]) == 0
    assert (prof / "one_batch_bs2.json").exists() and "Self CPU" in (prof / "one_batch_bs2.txt").read_text()
    assert [bs for bs, _ in seen] == [1, 2, 1, 2] and not any(on for _, on in seen)      # warm-ups, then the runs
