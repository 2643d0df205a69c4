"""The one-shot all-reduce over peer buffers on two CPU ranks (shared memory, the Triton kernel under the
interpreter): against gloo's all-reduce and the reference, call after call (both staging halves, row counts
that change), and in the model against one process."""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from mlaserve.distributed import spawn_ranks
from mlaserve.distributed.peer import PEER_CALL_MAX_BYTES, max_call_bytes
from mlaserve.kernels.allreduce import LL_ROWS, ll_chunk, peer_all_reduce_ref

# (rows, hidden, dtype) of consecutive calls: repeats reuse both staging halves and row flags at several epochs;
# the one of 128 x 2100 fp32 (1.03 MiB) exceeds PEER_CALL_MAX_BYTES and the last the buffers' 128 rows: both take gloo,
# between peer calls. No bf16: the interpreter rounds it otherwise (the
# GPU test covers it)
CALLS = [(1, 64, torch.float32), (3, 96, torch.float16), (1, 64, torch.float32), (7, 200, torch.float16),
         (2, 64, torch.float32), (128, 2100, torch.float32), (1, 64, torch.float16), (5, 130, torch.float32),
         (3, 96, torch.float16), (129, 8, torch.float32)]
EPS = 1e-6


def _calls_on_rank(group, seed: int, calls: list = CALLS) -> list[dict]:
    tp, rank = group.tp, group.info.rank
    assert tp.peer is not None and tp.peer.world == 2, tp
    dev = torch.device("cuda", torch.cuda.current_device()) if tp.nccl else torch.device("cpu")
    out = []
    for i, (t, d, dtype) in enumerate(calls):
        g = torch.Generator().manual_seed(seed + 1000 * i + rank)
        x = torch.randn(t, d, generator=g).to(dev, dtype)
        residual = torch.randn(t, d, generator=torch.Generator().manual_seed(seed + 1000 * i + 7)).to(dev, dtype)
        weight = torch.rand(d, generator=torch.Generator().manual_seed(seed + 1000 * i + 8)).to(dev, dtype) + 0.5
        parts = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(parts, x, group=tp.group)
        summed = x.clone()
        tp.all_reduce(summed)
        lib = x.clone()
        dist.all_reduce(lib, group=tp.group)                      # gloo, or NCCL on GPUs
        row = {"sum": summed, "lib": lib, "ref": peer_all_reduce_ref(parts), "fits": tp.peer.fits(x)}
        if tp.fuses_norm(x):
            res = residual.clone()
            normed, res_out = tp.all_reduce_add_norm(x.clone(), res, weight, EPS)
            want_n, want_r = peer_all_reduce_ref(parts, residual, weight, EPS)
            row |= {"normed": normed, "res": res_out, "res_in_place": res_out is res, "want_n": want_n,
                    "want_r": want_r, "split": tp.peer.split_chunk(x) is not None}
        if tp.peer.fits_push(x):                                  # the push variant, interleaved with the pull one
            pushed, res = tp.peer.all_reduce_push(x.clone()), residual.clone()
            normed_p, res_p = tp.peer.all_reduce_push(x.clone(), res, weight, EPS)
            assert res_p is res                                   # one program per row: in place
            # each row's columns pushed from 2-4 programs; with the norm only on GPUs (the interpreter runs one
            # program at a time, and a split row's programs wait for each other's columns)
            chunk = ll_chunk(d, 4)
            split = tp.peer.all_reduce_push(x.clone(), chunk=chunk)
            row |= {"push": pushed, "push_normed": normed_p, "push_res": res_p, "push_split": split}
            if dev.type == "cuda":
                res = residual.clone()
                row |= dict(zip(("push_split_normed", "push_split_res"),
                                tp.peer.all_reduce_push(x.clone(), res, weight, EPS, chunk=chunk)))
                assert row["push_split_res"] is res                   # in place too
        out.append({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in row.items()})
    return out


def test_peer_defaults():
    """Unset: the push variant for calls of <= PUSH_AUTO_ELEMS values, the in-kernel sums on, calls up to the 1 MiB
    half-buffer on the peer kernels (on since the epoch-race fix ran on two H200s); each setting turns its part off."""
    from mlaserve.distributed.peer import HALF_BYTES, PUSH_AUTO_ELEMS, SPLIT_AUTO_ROWS, peer_settings

    assert PEER_CALL_MAX_BYTES == HALF_BYTES == 1 << 20
    assert peer_settings({}, HALF_BYTES) == (PUSH_AUTO_ELEMS, True, 1 << 20, SPLIT_AUTO_ROWS)
    off = {"MLASERVE_PEER_PUSH": "0", "MLASERVE_KERNEL_SUMS": "0", "MLASERVE_PEER_MAX_BYTES": "0",
           "MLASERVE_PEER_SPLIT": "0"}
    assert peer_settings(off, HALF_BYTES) == (0, False, 0, 0)


def test_peer_max_call_bytes_setting():
    assert max_call_bytes("", 1 << 20) == PEER_CALL_MAX_BYTES and max_call_bytes("", 4096) == 4096
    assert max_call_bytes("1048576", 1 << 20) == 1 << 20 and max_call_bytes("0", 1 << 20) == 0
    for bad in ("lots", "-1", str((1 << 20) + 1)):
        with pytest.raises(ValueError, match="MLASERVE_PEER_MAX_BYTES"):
            max_call_bytes(bad, 1 << 20)


def test_peer_all_reduce_equals_gloo_call_after_call():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    _check_calls(CALLS, spawn_ranks(_calls_on_rank, 2, seed, peer_all_reduce=True, timeout=600))


@pytest.mark.multi_gpu
def test_peer_all_reduce_equals_nccl_on_two_gpus():
    """Two GPUs over CUDA IPC: the same calls in bf16 at decode's shapes, against NCCL."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    calls = [(t, d, torch.bfloat16) for t, d, _ in CALLS[:-1]] + GPU_CALLS + [(200, 7168, torch.bfloat16)]
    _check_calls(calls, spawn_ranks(_calls_on_rank, 2, seed, calls, device="cuda", peer_all_reduce=True,
                                    timeout=600))


def _check_calls(calls: list, ranks: list) -> None:
    for i, ((t, d, dtype), a, b) in enumerate(zip(calls, *ranks)):
        assert a["fits"] == (t <= 128 and t * d * a["sum"].element_size() <= PEER_CALL_MAX_BYTES), (i, t, d)
        assert torch.equal(a["sum"], b["sum"]), f"call {i}: the ranks' sums differ"
        assert torch.equal(a["sum"], a["ref"]), f"call {i}: sum != fp32 sum in rank order"
        # two terms: fp32 a + b rounded once is gloo's (NCCL's) a + b in the tensor's own dtype
        assert torch.equal(a["sum"], a["lib"]), f"call {i}: sum != gloo's / NCCL's"
        if not a["fits"]:
            assert "normed" not in a
            continue
        assert ("push" in a) == (t <= LL_ROWS), (i, t, d)
        if "push" in a:                                           # the push variant: the same bits
            assert torch.equal(a["push"], a["sum"]) and torch.equal(b["push"], b["sum"]), f"call {i}: push sum"
            assert torch.equal(a["push_res"], a["res"]), f"call {i}: push residual"
            if a["split"]:                                        # the model's call split the row: see below
                torch.testing.assert_close(a["push_normed"].float(), a["normed"].float(), rtol=1e-2, atol=1e-2)
            else:
                assert torch.equal(a["push_normed"], a["normed"]), f"call {i}: push norm"
            assert torch.equal(a["push_split"], a["sum"]) and torch.equal(b["push_split"], b["sum"]), \
                f"call {i}: split push sum"
            if "push_split_normed" in a:                          # its sum of squares added in another order
                assert torch.equal(a["push_split_res"], a["res"]), f"call {i}: split push residual"
                assert torch.equal(a["push_split_normed"], b["push_split_normed"]), f"call {i}: split push ranks"
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(a["push_split_normed"].float(), a["normed"].float(), rtol=tol, atol=tol)
        assert a["res_in_place"]
        assert torch.equal(a["res"], a["want_r"]) and torch.equal(a["res"], b["res"]), f"call {i}: residual"
        assert torch.equal(a["normed"], b["normed"]), f"call {i}: the ranks' norms differ"
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a["normed"].float(), a["want_n"].float(), rtol=tol, atol=tol)


def _model_on_ranks(group, path: str, msgs: list, flags: dict) -> dict:
    from test_tensor_parallel import _scheduler
    from seq_runner import drive_scheduler
    from mlaserve.layers.moe import MoE

    tp = group.tp
    assert tp.peer is not None
    fused, plain, folds = [], [], []
    tp.all_reduce_add_norm = _counted(tp.all_reduce_add_norm, fused)
    tp.peer.all_reduce = _counted(tp.peer.all_reduce, plain)
    sched = _scheduler(path, group, max_total_tokens=512, **flags)
    for m in sched.runner.model.modules():
        if isinstance(m, MoE):
            m.forward_normed = _noting(m.forward_normed, folds)
    return {"out": drive_scheduler(sched, msgs), "fused": len(fused), "plain": len(plain),
            "push": tp.peer.push_elems, "in_router": folds.count("router"),
            "in_combine": folds.count("combine")}


def _noting(fn, calls: list):
    """MoE.forward_normed, noting which kernels sum over the ranks: "router" (sum_in given), "combine"
    (all_reduce given)."""
    def noted(x, residual, norm, next_norm=None, all_reduce=None, sum_in=None, row_mask=None):
        calls.extend(["router"] * (sum_in is not None) + ["combine"] * (all_reduce is not None))
        return fn(x, residual, norm, next_norm, all_reduce, sum_in, row_mask)
    return noted


def _counted(fn, calls: list):
    def counted(*args):
        calls.append(1)
        return fn(*args)
    return counted


@pytest.mark.parametrize("kernel", ["pull", "push", "auto", "auto-triton"])
def test_tp2_over_peer_buffers_equals_one_process(tmp_path, monkeypatch, kernel):
    """The model's all-reduces over the peer buffers, with the norms after them fused in (V3 shape with a dense
    first layer, fp32; the model's other ops the PyTorch references): greedy outputs equal one process's. `push`:
    MLASERVE_PEER_PUSH=1 gives the calls of <= LL_ROWS rows to the push variant, auto (the default) the smallest,
    0 none (`pull`). `auto-triton`: every op a Triton kernel (the interpreter) and MLASERVE_KERNEL_SUMS=1 (the
    default), so the router sums the attention output over the ranks (moe_route_norm's all_reduce) and a one-token
    MoE layer's experts' combine its output (fused_moe_norm's), instead of all-reduces around them."""
    monkeypatch.setenv("MLASERVE_PEER_PUSH", {"pull": "0", "push": "1"}.get(kernel, "auto"))   # ranks inherit it
    monkeypatch.setenv("MLASERVE_KERNEL_SUMS", "1" if kernel == "auto-triton" else "0")
    flags = dict(attention_backend="triton") if kernel == "auto-triton" else {}
    from parallel_common import checkpoint_builder
    from test_tensor_parallel import _msg, _scheduler
    from seq_runner import drive_scheduler

    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    # the last request decodes alone for its last steps: one-token decodes (the fold's case) as well as batched ones.
    # Every op interpreted (auto-triton) took 325 s for 3 requests on two CPU cores: fewer, shorter requests there
    n, longest, steps = (2, 10, 3) if kernel == "auto-triton" else (3, 30, 8)
    msgs = [_msg(f"r{i}", [rng.randrange(5, 4000) for _ in range(rng.randint(3, longest))], steps + 4 * (i == n - 1))
            for i in range(n)]
    path = checkpoint_builder(tmp_path)("v3")
    one = drive_scheduler(_scheduler(path, max_total_tokens=512, **flags), msgs)
    ranks = spawn_ranks(_model_on_ranks, 2, path, msgs, flags, peer_all_reduce=True, timeout=900)
    assert ranks[0] == ranks[1], "the two ranks disagree"
    assert ranks[0]["fused"] > 0 and ranks[0]["plain"] > 0, ranks[0]
    assert (ranks[0]["push"] > 0) == (kernel != "pull"), ranks[0]["push"]
    assert (ranks[0]["in_combine"] > 0) == (ranks[0]["in_router"] > 0) == (kernel == "auto-triton"), ranks[0]
    assert {r: o["ids"] for r, o in ranks[0]["out"].items()} == {r: o["ids"] for r, o in one.items()}


# --- on one GPU: two processes over CUDA IPC (the GPU time-slices their spinning programs: correctness only) ---

GPU_CALLS = [(1, 7168, torch.bfloat16), (16, 7168, torch.bfloat16), (1, 2048, torch.bfloat16),
             (64, 7168, torch.bfloat16), (3, 2048, torch.float16), (5, 1000, torch.float32), (1, 7168, torch.bfloat16)]


def _gpu_calls_on_rank(group, seed: int) -> list[dict]:
    from mlaserve.distributed.peer import PeerAllReduce

    rank, dev = group.info.rank, torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    peer = PeerAllReduce(rank, [0, 1], dist.group.WORLD, dev)

    def inputs(i: int, t: int, d: int, dtype: torch.dtype, round_: int):
        g = torch.Generator().manual_seed(seed + 1000 * i + 100 * round_ + rank)
        x = torch.randn(t, d, generator=g).to(dtype)
        res = torch.randn(t, d, generator=torch.Generator().manual_seed(seed + 1000 * i + 100 * round_ + 7))
        w = torch.rand(d, generator=torch.Generator().manual_seed(seed + 1000 * i + 8)) + 0.5
        parts = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(parts, x)                                 # gloo, on the host
        return x, res.to(dtype), w.to(dtype), parts

    def check(x, res, w, parts, summed, normed, res_out) -> dict:
        want = peer_all_reduce_ref(parts)
        want_n, want_r = peer_all_reduce_ref(parts, res, w, EPS)
        return {"sum_exact": torch.equal(summed.cpu(), want), "res_exact": torch.equal(res_out.cpu(), want_r),
                "norm_err": (normed.cpu().float() - want_n.float()).abs().max().item(), "sum": summed.cpu()}

    rows = []
    for i, (t, d, dtype) in enumerate(GPU_CALLS):                # eager
        x, res, w, parts = inputs(i, t, d, dtype, 0)
        summed = peer.all_reduce(x.to(dev))
        res_d = res.to(dev)
        normed, res_out = peer.all_reduce_add_norm(x.to(dev), res_d, w.to(dev), EPS)
        rows.append({"mode": "eager", "i": i} | check(x, res, w, parts, summed, normed, res_out))
    # a CUDA graph of every call, replayed with new inputs: the epochs advance on the device
    static = [[a.to(dev) for a in inputs(i, t, d, dtype, 0)[:3]] for i, (t, d, dtype) in enumerate(GPU_CALLS)]
    sums = [torch.empty_like(x) for x, _, _ in static]
    graph, outs = torch.cuda.CUDAGraph(), []
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for (x, res, w), s in zip(static, sums):
            s.copy_(x)
            peer.all_reduce(s)
            outs.append(peer.all_reduce_add_norm(x, res, w, EPS)[0])
    for round_ in (1, 2, 3):
        fresh = [inputs(i, t, d, dtype, round_) for i, (t, d, dtype) in enumerate(GPU_CALLS)]
        for (x, res, w), (fx, fres, _, _) in zip(static, fresh):
            x.copy_(fx)
            res.copy_(fres)
        graph.replay()
        torch.cuda.synchronize()
        for i, ((x, res, w), f) in enumerate(zip(static, fresh)):
            rows.append({"mode": f"graph {round_}", "i": i} | check(f[0], f[1], f[2], f[3], sums[i], outs[i], res))
    return rows


@pytest.mark.gpu
def test_peer_all_reduce_on_one_gpu_over_cuda_ipc():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    ranks = spawn_ranks(_gpu_calls_on_rank, 2, seed, peer_all_reduce=False, timeout=600)
    for a, b in zip(*ranks):
        where = f"{a['mode']} call {a['i']} {GPU_CALLS[a['i']]}"
        assert a["sum_exact"] and a["res_exact"], where
        assert torch.equal(a["sum"], b["sum"]), f"{where}: the ranks' sums differ"
        tol = 1e-5 if GPU_CALLS[a["i"]][2] == torch.float32 else 2e-2
        assert a["norm_err"] <= tol * 4, (where, a["norm_err"])


def test_which_groups_can_use_peer_buffers():
    from mlaserve.distributed.peer import peer_members, why_not_peer

    assert peer_members(5, 1, 2) == [4, 5] and peer_members(0, 0, 4) == [0, 1, 2, 3]   # DP group 2 of 2-rank groups
    assert why_not_peer(torch.device("cpu"), [0, 1], 1, [-1, -1]) == "the group spans nodes"  # 2 nodes x 1 rank
    assert why_not_peer(torch.device("cpu"), [0, 1], 2, [-1, -1]) == "the ranks run on the CPU (gloo)"


def test_push_setting_is_checked():
    from mlaserve.distributed.peer import PUSH_AUTO_ELEMS, push_elems

    assert push_elems("auto") == PUSH_AUTO_ELEMS and push_elems("0") == 0 and push_elems("1") >= LL_ROWS * 2048
    with pytest.raises(ValueError, match="MLASERVE_PEER_PUSH='yes'"):
        push_elems("yes")


def test_split_setting_is_checked():
    from mlaserve.distributed.peer import SPLIT_AUTO_ROWS, split_rows

    assert split_rows("") == SPLIT_AUTO_ROWS and split_rows("0") == 0 and split_rows(str(LL_ROWS)) == LL_ROWS
    for bad in ("yes", "-1", str(LL_ROWS + 1)):
        with pytest.raises(ValueError, match="MLASERVE_PEER_SPLIT"):
            split_rows(bad)


def test_which_calls_take_the_split_push():
    """On a GPU: the calls of more values than the whole-row push takes, up to `split_rows` rows, about SPLIT_COLS
    columns a program; never on the CPU (a split row's programs wait for each other, the interpreter runs one at a
    time)."""
    from types import SimpleNamespace

    from mlaserve.distributed.peer import SPLIT_COLS, PeerAllReduce

    peer = SimpleNamespace(push_elems=4096, split_rows=8, ll=SimpleNamespace(fits=lambda x: x.shape[0] <= LL_ROWS))
    peer.pushes = lambda x: PeerAllReduce.pushes(peer, x)

    def chunk(t: int, d: int, dev: str = "cuda") -> int | None:       # a [t, d] tensor's shape on `dev`
        x = SimpleNamespace(shape=(t, d), device=torch.device(dev), numel=lambda: t * d)
        return PeerAllReduce.split_chunk(peer, x)

    assert PeerAllReduce.split_chunk.__doc__ and SPLIT_COLS == 1024
    assert chunk(1, 7168) == chunk(8, 7168) == 1024 and chunk(1, 5120) == 1024 and chunk(4, 2048) == 1024
    assert chunk(1, 2048) is None and chunk(2, 2048) is None              # the whole-row push takes them
    assert chunk(9, 7168) is None and chunk(1, 7168, "cpu") is None
    peer.split_rows = 0
    assert chunk(1, 7168) is None


def test_kernel_sums_setting():
    """The router's and the one-token combine's own sums over the ranks (`push_group`) only with
    MLASERVE_KERNEL_SUMS=1 (the default); with 0 the model all-reduces before them."""
    from types import SimpleNamespace

    from mlaserve.distributed import TensorParallel
    from mlaserve.distributed.peer import kernel_sums

    assert kernel_sums("1") and not kernel_sums("0")
    with pytest.raises(ValueError, match="MLASERVE_KERNEL_SUMS='on'"):
        kernel_sums("on")
    tp, x = TensorParallel(0, 2), torch.zeros(1, 2048)
    for on in (False, True):
        tp.peer = SimpleNamespace(fits=lambda x: True, pushes=lambda x: True, kernel_sums=on, ll_group="ll")
        assert tp.push_group(x) == ("ll" if on else None)


# --- the experts' combine summing its rows over the ranks itself (fused_moe_norm's all_reduce) -----------------

def _moe_norm_on_rank(group, seed: int, dtype: torch.dtype) -> list[dict]:
    from mlaserve.kernels.allreduce import LLGroup
    from mlaserve.kernels.fused_moe import fused_moe, fused_moe_norm

    peer, rank = group.tp.peer, group.info.rank
    e, hidden, inter, k = 4, 64, 32, 2
    shared = torch.Generator().manual_seed(seed)                   # x, routing, residual: the same on both ranks
    mine = torch.Generator().manual_seed(seed + 1 + rank)          # this rank's shard of the experts
    w13 = (torch.randn(e, 2 * inter, hidden, generator=mine) / 8).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=mine) / 8).to(dtype)
    sync, grp, rows = torch.zeros(hidden // 16 + 1, dtype=torch.int32), LLGroup(peer.ll, peer.rank, peer.world), []
    for i in range(3):                                             # interleaved with the push kernel's own calls
        x = torch.randn(1, hidden, generator=shared).to(dtype)
        residual = torch.randn(1, hidden, generator=shared).to(dtype)
        nw = (torch.rand(hidden, generator=shared) + 0.5).to(dtype)
        ids = torch.randperm(e, generator=shared)[:k].view(1, k).to(torch.int32)
        tw = torch.rand(1, k, generator=shared)
        h, ro = fused_moe_norm(x, w13, w2, tw, ids, residual, nw, EPS, sync=sync, all_reduce=grp)
        part = fused_moe(x, w13, w2, tw, ids, sync=sync)           # the unfused path: combine, then the push kernel
        want_h, want_ro = peer.all_reduce_push(part, residual.clone(), nw, EPS)
        rows.append({"h": h, "ro": ro, "want_h": want_h, "want_ro": want_ro, "sync_clear": not sync.any()})
        peer.all_reduce_push(torch.randn(2, hidden, generator=shared).to(dtype))
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_norm_sums_over_the_ranks_in_its_combine(dtype):
    """Two CPU ranks, each with its own shard of the experts: the combine's last program sums the token's row over
    the ranks before the next norm, equal to the experts' output run through the push all-reduce + norm."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    ranks = spawn_ranks(_moe_norm_on_rank, 2, seed, dtype, peer_all_reduce=True, timeout=600)
    for i, (a, b) in enumerate(zip(*ranks)):
        assert a["sync_clear"] and b["sync_clear"], f"call {i}: counts left set"
        assert torch.equal(a["ro"], a["want_ro"]) and torch.equal(a["ro"], b["ro"]), f"call {i}: sum + residual"
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(a["h"], a["want_h"], atol=tol, rtol=tol)
        assert torch.equal(a["h"], b["h"]), f"call {i}: the ranks' norms differ"


def _route_norm_on_rank(group, seed: int, dtype: torch.dtype) -> list[dict]:
    from mlaserve.kernels.moe_topk import moe_route_norm

    peer, rank = group.tp.peer, group.info.rank
    e, hidden, k = 16, 64, 4
    shared = torch.Generator().manual_seed(seed)
    mine = torch.Generator().manual_seed(seed + 1 + rank)
    gate = torch.randn(e, hidden, generator=shared).to(dtype)
    routing = dict(topk_method="greedy", scoring_func="softmax")
    rows = []
    for i, t in enumerate((1, 2, 1)):                              # interleaved with the push kernel's own calls
        x = torch.randn(t, hidden, generator=mine).to(dtype)       # this rank's share of the attention output
        residual = torch.randn(t, hidden, generator=shared).to(dtype)
        nw = (torch.rand(hidden, generator=shared) + 0.5).to(dtype)
        got = moe_route_norm(x, residual, nw, EPS, gate, k, all_reduce=peer.ll_group, **routing)
        summed = peer.all_reduce_push(x.clone())                   # the unfused path: the push kernel, then the router
        want = moe_route_norm(summed, residual, nw, EPS, gate, k, **routing)
        rows.append({"got": got, "want": want})
        peer.all_reduce_push(torch.randn(3, hidden, generator=shared).to(dtype))
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_route_norm_sums_over_the_ranks_in_its_launch(dtype):
    """Two CPU ranks with their own shares of the attention output: the router's launch sums them over the ranks
    before the add + norm and the gate: weights, ids, normed rows and residual equal the push all-reduce followed
    by the router, on both ranks."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    ranks = spawn_ranks(_route_norm_on_rank, 2, seed, dtype, peer_all_reduce=True, timeout=600)
    for i, (a, b) in enumerate(zip(*ranks)):
        for j, name in enumerate(("weights", "ids", "normed", "residual")):
            assert torch.equal(a["got"][j], a["want"][j]), f"call {i}: {name}"
            assert torch.equal(a["got"][j], b["got"][j]), f"call {i}: the ranks' {name} differ"
