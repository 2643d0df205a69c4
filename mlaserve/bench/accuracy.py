"""`mlaserve bench accuracy`: held-out bits per byte and greedy agreement with fp32, one row per serving mode.

Text: pip's source (never trained on; `tools/corpus.py`), cut into windows. Each window is prefilled for its first
`--prefill` tokens, then decoded one token at a time, teacher-forced (the input of each step is the text's next
token), so every mode reads its own KV cache through the decode path it serves with. A row's figures:
bits per byte over every predicted token, the share of positions whose greedy token equals the fp32 row's, and
whether bits per byte is within the mode's tolerance of fp32's.

The parallel modes (tp 2, ep 2, DP attention) run on spawned ranks, NCCL on GPUs or gloo on the CPU, each rank
the same teacher-forced driver; under DP attention each group takes every D-th window.

    mlaserve bench accuracy [--model-path DIR] [--windows 16 --window-len 256 --prefill 128] [--modes NAME ...]
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class Mode:
    name: str
    flags: dict                 # ServerConfig flat overrides
    tolerance: float            # allowed relative bits-per-byte excess over fp32
    fp8_weights: bool = False   # run the block-FP8 copy of the checkpoint
    gpu_only: bool = False
    verify_tokens: int = 1      # decode this many text tokens per step, as a speculative verify step does

    @property
    def world(self) -> int:
        """Ranks the mode runs on (one process each)."""
        return self.flags.get("tp_size", 1)

    @property
    def dp(self) -> int:
        """DP-attention groups (1: none)."""
        return self.flags.get("dp_size", 1)

    @property
    def layout(self) -> tuple[int, int]:
        """(ranks, DP groups): modes of one layout can run on the same spawned ranks."""
        return self.world, self.dp


EAGER = {"disable_cuda_graph": True}
FP32 = {"dtype": "float32", **EAGER}
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
# NOTE: the parallel modes run in fp32 and are held to 0.01%: they must not change the model's numbers, only the
# order of its fp32 sums (all-reduce of the heads' and experts' shares, the MoE over gathered rows), which moves a
# log-prob by ~1e-6. A wrong shard, a lost expert or another group's rows cost percents; in bf16 the 2% allowed
# for bf16's own rounding would hide them.
EXACT = 1e-4
# NOTE: the first mode is the reference every row is compared with. Adding a mode is one line.
MODES = (
    Mode("fp32", FP32, 0.0),
    Mode("bf16", {"dtype": "bfloat16", **EAGER}, 0.02),
    Mode("bf16, non-absorbed (--disable-mla)", {"dtype": "bfloat16", "disable_mla": True}, 0.02),
    Mode("bf16, CUDA graphs", {"dtype": "bfloat16"}, 0.02, gpu_only=True),
    Mode("FP8 weights (block 128x128)", {"dtype": "bfloat16", **EAGER}, 0.05, fp8_weights=True),
    Mode("FP8 weights, CUDA graphs", {"dtype": "bfloat16"}, 0.05, fp8_weights=True, gpu_only=True),
    Mode("bf16, KV cache fp8_e4m3", {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", **EAGER}, 0.05),
    Mode("bf16, KV cache fp8_e5m2", {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2", **EAGER}, 0.10),
    Mode("bf16, speculative verify (4 tokens a step)", {"dtype": "bfloat16", **EAGER}, 0.02, verify_tokens=4),
    Mode("fp32, tp 2", {**FP32, "tp_size": 2}, EXACT),
    Mode("fp32, tp 2 + ep 2", {**FP32, "tp_size": 2, "ep_size": 2}, EXACT),
    Mode("fp32, tp 2 dp 2 dp-attention", {**FP32, **DP_ATTENTION}, EXACT),
    Mode("fp32, tp 2 dp 2 dp-attention + ep 2", {**FP32, **DP_ATTENTION, "ep_size": 2}, EXACT),
)


class ModeResult(NamedTuple):
    logprobs: torch.Tensor      # [N, S - 1] float64: log p(window[:, i + 1] | window[:, : i + 1])
    greedy: torch.Tensor        # [N, S - 1] argmax at each position


class TeacherForced:
    """Drives one ModelRunner over N windows at once: a prefill of P tokens, then S - 1 - P decode steps.
    Request b owns slots 1 + b * S ... (slot 0 is the CUDA-graph padding slot, row N the graphs' dummy).

    Under DP attention `group_windows` holds every group's window count: each group runs the same forwards (one
    prefill, the same decode steps), so each forward's per-group token counts (the MoE gather's layout) are
    window count * tokens per window, agreed without a message."""

    def __init__(self, runner, n: int, s: int, group_windows: list[int] | None = None):
        self.runner, self.n, self.s, self.group_windows = runner, n, s, group_windows
        dev = runner.device
        self.req_to_token = torch.zeros(n + 1, s, dtype=torch.int32, device=dev)
        self.req_to_token[:n] = (1 + torch.arange(n * s, device=dev).view(n, s)).int()
        runner.attach(self.req_to_token)
        runner.init_cuda_graphs(self.req_to_token, dummy_req=n)

    def _ctx(self, mode, start: int, length: int, num_q: int = 1):
        from mlaserve.engine.forward_batch import build_context

        slots = self.req_to_token[: self.n, start:start + length].reshape(-1).long()
        ctx = build_context(mode, req_pool_idx=list(range(self.n)), prefix_lens=[start] * self.n,
                            extend_lens=[length] * self.n, out_slots=slots, req_to_token=self.req_to_token,
                            kv_pool=self.runner.pool, attn_backend=self.runner.attn_backend,
                            device=self.runner.device, num_q=num_q, last_token_logits=False)
        if self.group_windows is not None:
            ctx.global_num_tokens = [w * length for w in self.group_windows]
        return ctx

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, prefill: int, verify_tokens: int = 1) -> ModeResult:
        """tokens [N, S] (on the runner's device) -> log-probs and greedy tokens of positions 1 .. S-1.
        With `verify_tokens` k > 1 each decode step takes the text's next k tokens at once (a speculative verify
        step whose drafts are the text: the multi-query decode path)."""
        from mlaserve.core import ForwardMode

        model, graphs = self.runner.model, self.runner.graphs
        ctx = self._ctx(ForwardMode.EXTEND, 0, prefill)
        logits = model(tokens[:, :prefill].reshape(-1), ctx.positions, ctx).logits.view(self.n, prefill, -1)
        lp, greedy = [_score(logits, tokens[:, 1:prefill + 1])], [logits.argmax(-1)]
        rows = torch.arange(self.n, device=tokens.device)
        for i in range(prefill, self.s - 1, verify_tokens) if verify_tokens > 1 else ():
            k = min(verify_tokens, self.s - 1 - i)
            ctx = self._ctx(ForwardMode.DECODE, i, k, num_q=k)
            step = model(tokens[:, i:i + k].reshape(-1), ctx.positions, ctx).logits.view(self.n, k, -1)
            lp.append(_score(step, tokens[:, i + 1:i + 1 + k]))
            greedy.append(step.argmax(-1))
        for i in range(prefill, self.s - 1) if verify_tokens == 1 else ():
            ctx = self._ctx(ForwardMode.DECODE, i, 1)
            if graphs is not None:
                step = graphs.replay(tokens[:, i], ctx.positions, ctx.out_slots, rows, ctx.seq_lens)
            else:
                step = model(tokens[:, i], ctx.positions, ctx).logits            # [N, V]
            lp.append(_score(step[:, None], tokens[:, i + 1:i + 2]))
            greedy.append(step.argmax(-1)[:, None])
        return ModeResult(torch.cat(lp, 1).cpu(), torch.cat(greedy, 1).cpu())


def _score(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # logits [N, n, V], targets [N, n] -> log-probs [N, n] float64
    return logits.double().log_softmax(-1).gather(-1, targets[..., None].long())[..., 0]


def run_mode(path: str, mode: Mode, windows: np.ndarray, prefill: int, base: dict) -> ModeResult:
    """The mode's log-probs and greedy tokens over `windows` [N, S] (of the checkpoint at `path`)."""
    return run_modes([(path, mode)], windows, prefill, base)[0]


def run_modes(jobs: list[tuple[str, Mode]], windows: np.ndarray, prefill: int, base: dict) -> list[ModeResult]:
    """(checkpoint, mode) jobs of one `Mode.layout`, one after another: in this process, or on one set of `world`
    spawned ranks (NCCL on GPUs, gloo on the CPU; starting them costs more than a run of the demo model) whose
    results are put back in window order."""
    layouts = {m.layout for _, m in jobs}
    assert len(layouts) == 1, f"jobs of one rank layout, not {layouts}"
    (world, dp), = layouts
    if len(windows) < dp:
        raise ValueError(f"{len(windows)} windows for {dp} DP groups (give each one)")
    if world == 1:
        return [_result(r) for r in _run_jobs(None, jobs, windows, prefill, base, None)]
    from mlaserve.distributed import spawn_ranks

    dev = "cuda" if torch.cuda.is_available() and base.get("device", "auto") in ("auto", "cuda") else "cpu"
    ranks = spawn_ranks(_run_jobs, world, jobs, windows, prefill, base, dev, device=dev, dp_size=dp)
    leaders = [ranks[d * world // dp] for d in range(dp)]        # the first rank of each DP group
    results = []
    for j in range(len(jobs)):
        lp, greedy = np.empty(windows[:, 1:].shape), np.empty(windows[:, 1:].shape, dtype=np.int64)
        for d, got in enumerate(leaders):                            # group d ran windows d::dp
            lp[d::dp], greedy[d::dp] = got[j]
        results.append(_result((lp, greedy)))
    return results


def _result(arrays: tuple[np.ndarray, np.ndarray]) -> ModeResult:
    return ModeResult(torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1]))


def _run_jobs(group, jobs: list[tuple[str, Mode]], windows: np.ndarray, prefill: int, base: dict,
              device: str) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for path, mode in jobs:
        out.append(run_rank(group, path, mode, windows, prefill, base, device))
        gc.collect()                                  # the last mode's runner (weights, KV pool) before the next
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def run_rank(group, path: str, mode: Mode, windows: np.ndarray, prefill: int, base: dict,
             device: str | None) -> tuple[np.ndarray, np.ndarray]:
    """One rank's teacher-forced run (every rank of a group the same: SPMD) over its DP group's windows, d::D
    (all of them without DP attention). Returns numpy log-probs and greedy tokens: they cross the spawn boundary.
    `device` "cuda": this rank's GPU (cuda:rank)."""
    from mlaserve.config import ServerConfig
    from mlaserve.engine.engine import ModelRunner, resolve_for_device

    rank, dp_rank = (group.info.rank, group.info.dp_rank) if group is not None else (0, 0)
    mine = windows[dp_rank::mode.dp]
    n, s = mine.shape
    most = len(windows[::mode.dp])                    # NOTE: every rank sizes its pool for the largest group's
    dev = {"device": f"cuda:{rank}"} if device == "cuda" else {}
    server = ServerConfig.from_flat(model_path=path, max_total_tokens=most * s + 16, context_length=s,
                                    max_running_requests=most, log_level="warning", **(base | mode.flags | dev))
    runner = ModelRunner(resolve_for_device(server, path), path, group)
    counts = [len(windows[d::mode.dp]) for d in range(mode.dp)] if mode.dp > 1 else None
    driver = TeacherForced(runner, n, s, counts)
    res = driver.run(torch.from_numpy(mine.astype(np.int64)).to(runner.device), prefill, mode.verify_tokens)
    return res.logprobs.numpy(), res.greedy.numpy()


@dataclass
class Row:
    mode: str
    bits_per_byte: float
    rel: float                  # relative to fp32
    agreement: float            # greedy tokens equal to fp32's
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel <= self.tolerance


def summarise(mode: Mode, res: ModeResult, ref: ModeResult | None, weights: torch.Tensor) -> Row:
    """weights [N, S - 1]: bytes of each target token (0 = special, not scored)."""
    scored = weights > 0
    bpb = float(-res.logprobs[scored].sum() / math.log(2) / weights.sum())
    ref_bpb = bpb if ref is None else float(-ref.logprobs[scored].sum() / math.log(2) / weights.sum())
    agree = 1.0 if ref is None else float((res.greedy == ref.greedy)[scored].float().mean())
    return Row(mode.name, bpb, bpb / ref_bpb - 1, agree, mode.tolerance)


def format_table(rows: list[Row], tokens: int, nbytes: int) -> str:
    lines = [f"held-out: pip's source, {tokens} predicted tokens ({nbytes} bytes)", "",
             "| mode | bits/byte | vs fp32 | greedy = fp32 | tolerance | ok |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.mode} | {r.bits_per_byte:.4f} | {100 * r.rel:+.2f}% | {100 * r.agreement:.2f}% "
                     f"| {100 * r.tolerance:g}% | {'yes' if r.ok else 'NO'} |")
    return "\n".join(lines)


def fp8_copy(path: str, is_demo: bool, tmp: Path) -> str:
    """The block-FP8 version of the checkpoint: the demo model's cached copy, or a fresh one in `tmp`."""
    from mlaserve import demo
    from mlaserve.tools.quantize_fp8 import quantize_checkpoint

    if is_demo:
        return str(demo.fp8_dir() if demo.has_fp8() else demo.build_fp8())

    return str(quantize_checkpoint(path, tmp / "fp8"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mlaserve bench accuracy", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="a bf16 checkpoint (default: the built-in demo model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows, run as one batch")
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=128, help="tokens of each window prefilled; the rest decoded")
    ap.add_argument("--modes", nargs="+", default=None, metavar="NAME",
                    help="modes to run, by their row names, e.g. 'fp32, tp 2' (default: all that can run here)")
    ap.add_argument("--output-file", help="write the rows as JSON")
    return ap.parse_args(argv)


def selected_modes(names: list[str] | None, gpus: int) -> list[Mode]:
    """The fp32 reference, then the modes named (default: all) that run here: `gpus` GPUs (0: the CPU, where every
    mode but the CUDA-graph ones runs, the parallel ones on gloo ranks). Raises ValueError on an unknown name."""
    unknown = sorted(set(names or ()) - {m.name for m in MODES})
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; modes: " + "; ".join(m.name for m in MODES))
    modes = [m for m in MODES if runs_here(m, gpus)]
    if names:
        modes = [m for m in modes if m.name == MODES[0].name or m.name in names]
    return modes


def runs_here(mode: Mode, gpus: int) -> bool:
    return mode.world <= gpus if gpus else not mode.gpu_only


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tokenizers

    from mlaserve.demo import DEMO_DIR
    from mlaserve.tools import corpus

    path = args.model_path or str(DEMO_DIR)
    tok = tokenizers.Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    windows = corpus.heldout_windows(tok, args.window_len, args.windows)
    weights = torch.from_numpy(corpus.token_bytes(tok)[windows[:, 1:]])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and args.device != "cpu" else 0
    try:
        modes = selected_modes(args.modes, gpus)
    except ValueError as e:
        raise SystemExit(f"mlaserve bench accuracy: {e}") from None
    for m in MODES:
        if (not args.modes or m.name in args.modes) and not runs_here(m, gpus):
            print(f"skipping {m.name}: needs " + (f"{m.world} GPUs" if gpus else "a GPU"), flush=True)
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        # one process: a mode at a time; parallel modes of one layout on one set of ranks
        for _, batch in itertools.groupby(modes, key=lambda m: m.layout if m.world > 1 else m.name):
            batch = list(batch)
            jobs = [(fp8_copy(path, args.model_path is None, Path(tmp)) if m.fp8_weights else path, m) for m in batch]
            for mode, res in zip(batch, run_modes(jobs, windows, args.prefill, {"device": args.device})):
                rows.append(summarise(mode, res, ref, weights))
                ref = ref or res
                print(f"{mode.name}: {rows[-1].bits_per_byte:.4f} bits/byte", flush=True)
    print(format_table(rows, int((weights > 0).sum()), int(weights.sum())))
    if args.output_file:
        Path(args.output_file).write_text(json.dumps([r.__dict__ | {"ok": r.ok} for r in rows], indent=2) + "\n")
    return 0 if all(r.ok for r in rows) else 1
