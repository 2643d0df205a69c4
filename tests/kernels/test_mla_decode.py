"""mla_decode (Triton, CPU interpreter here) against mla_decode_ref on ragged paged caches."""
from __future__ import annotations

import math
import random

import pytest
import torch
import mlaserve.kernels.mla_decode as md
from mlaserve.bench.kernel_cases import mla_decode as bench_case
from mlaserve.kernels.mla_decode import (MAX_SPLITS, MIN_SPLIT_TOKENS, NUM_SMS, choose_num_kv_splits, decode_programs,
                                         mla_decode, mla_decode_ref, pick_config)

# Tolerances (max abs error; outputs are averages of N(0, 1) values, so |out| <= ~3):
#   fp32 q: dots are exact fp32 in the interpreter, only summation order differs -> 1e-4.
#   fp16 q: P is rounded to fp16 before P @ V and the output is stored in fp16 -> 4e-3.
#   fp8 cache: both sides read the same stored fp8 values (exact in fp16) -> as for the q dtype.
TOL = {torch.float32: 1e-4, torch.float16: 4e-3}


def make_case(device: str, lens: list[int], heads: int, big_l: int, rope: int, num_q: int,
              dtype: torch.dtype, kv_dtype: torch.dtype) -> dict:
    """Random paged cache: each request's positions map to scattered, distinct slots of a larger pool."""
    b, max_ctx = len(lens), max(lens) + 5
    num_slots = sum(lens) + 37
    perm = torch.randperm(num_slots, device=device).to(torch.int32)
    req_to_token = torch.full((b + 2, max_ctx), -1, dtype=torch.int32, device=device)
    rows = random.sample(range(b + 2), b)                # requests live in arbitrary pool rows
    used = 0
    for row, n in zip(rows, lens):
        req_to_token[row, :n] = perm[used:used + n]
        used += n
    kv = torch.randn(num_slots, big_l + rope, device=device)
    kv_scale = None
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kv_scale = 0.05 + random.random() * 0.1
        kv = (kv / kv_scale).to(kv_dtype)
    else:
        kv = kv.to(kv_dtype)
    return dict(q=torch.randn(b * num_q, heads, big_l + rope, device=device).to(dtype), kv_cache=kv,
                req_to_token=req_to_token, req_pool_idx=torch.tensor(rows, dtype=torch.int32, device=device),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                sm_scale=1.0 / math.sqrt(big_l // 4 + rope), kv_lora_rank=big_l, num_q=num_q, kv_scale=kv_scale)


def check(args: dict, tol: float, num_kv_splits: int | None = None) -> None:
    got = mla_decode(**args, num_kv_splits=num_kv_splits)
    want = mla_decode_ref(**args)
    assert got.shape == want.shape and got.dtype == args["q"].dtype
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_lengths_auto_splits(device: str, dtype: torch.dtype) -> None:
    lens = [1, random.randint(2, 60), random.randint(150, 300)]
    check(make_case(device, lens, heads=4, big_l=64, rope=16, num_q=1, dtype=dtype, kv_dtype=dtype), TOL[dtype])


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_splits_that_do_not_divide_the_length(device: str, splits: int) -> None:
    # Length 1 with 7 splits leaves most splits empty; 7 does not divide 131 or the tile size.
    lens = [1, 131, random.randint(40, 200)]
    check(make_case(device, lens, heads=16, big_l=64, rope=16, num_q=1, dtype=torch.float32,
                    kv_dtype=torch.float32), TOL[torch.float32], num_kv_splits=splits)


@pytest.mark.parametrize("splits", [None, 3])
def test_num_q_3_is_causal_per_query_token(device: str, splits: int | None) -> None:
    lens = [3, random.randint(4, 70), random.randint(100, 200)]
    args = make_case(device, lens, heads=4, big_l=64, rope=16, num_q=3, dtype=torch.float16,
                     kv_dtype=torch.float16)
    check(args, TOL[torch.float16], num_kv_splits=splits)
    # The first query token of the length-3 request sees only position 0: its output is that row's V.
    v0 = args["kv_cache"][args["req_to_token"][args["req_pool_idx"][0], 0].long(), :64].float()
    got = mla_decode(**args, num_kv_splits=splits)
    assert torch.allclose(got[0].float(), v0.expand(4, 64), atol=2e-3)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_with_scale(device: str, kv_dtype: torch.dtype) -> None:
    lens = [random.randint(1, 40), random.randint(100, 250)]
    check(make_case(device, lens, heads=4, big_l=64, rope=16, num_q=1, dtype=torch.float16,
                    kv_dtype=kv_dtype), TOL[torch.float16], num_kv_splits=2)


def test_real_deepseek_dims_tiny_context(device: str) -> None:
    # H=16 (V2-Lite), D = 512 + 64, a few tokens per request, one of them spanning two tiles.
    lens = [random.randint(1, 8), random.randint(65, 80)]
    check(make_case(device, lens, heads=16, big_l=512, rope=64, num_q=1, dtype=torch.float16,
                    kv_dtype=torch.float16), TOL[torch.float16])


@pytest.mark.parametrize("big_l,rope", [(32, 8), (48, 24), (24, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dims_that_are_not_powers_of_two_run_padded(device: str, big_l: int, rope: int, dtype: torch.dtype) -> None:
    # Small test configs (kv_lora_rank 32, rope 8) and odd widths: the tiles pad to powers of two >= 16.
    lens = [2, random.randint(20, 90), random.randint(130, 200)]
    check(make_case(device, lens, heads=5, big_l=big_l, rope=rope, num_q=2, dtype=dtype, kv_dtype=dtype),
          TOL[dtype], num_kv_splits=3)


def test_strided_q_and_out_buffer(device: str) -> None:
    args = make_case(device, [5, 90], heads=4, big_l=64, rope=16, num_q=1, dtype=torch.float32,
                     kv_dtype=torch.float32)
    args["q"] = torch.randn(2, 6, 100, device=device)[:, 1:5, :80]        # non-contiguous heads and tokens
    out = torch.full((2, 4, 64), float("nan"), device=device)
    res = mla_decode(**args, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert (out - mla_decode_ref(**args)).abs().max().item() <= TOL[torch.float32]


def test_empty_batch(device: str) -> None:
    args = make_case(device, [4], heads=4, big_l=64, rope=16, num_q=1, dtype=torch.float32,
                     kv_dtype=torch.float32)
    args.update(q=args["q"][:0], seq_lens=args["seq_lens"][:0], req_pool_idx=args["req_pool_idx"][:0])
    assert mla_decode(**args).shape == (0, 4, 64)


def test_bad_shapes_are_rejected_with_a_message(device: str) -> None:
    args = make_case(device, [4], heads=4, big_l=64, rope=16, num_q=1, dtype=torch.float32,
                     kv_dtype=torch.float32)
    with pytest.raises(AssertionError, match="kv_cache must be"):
        mla_decode(**{**args, "kv_cache": args["kv_cache"][:, :72]})
    with pytest.raises(AssertionError, match="num_q"):
        mla_decode(**{**args, "num_q": 2})


def test_split_choice_fills_the_gpu_without_tiny_splits() -> None:
    one_long = choose_num_kv_splits(programs=1, max_len=16384)
    assert one_long == min(MAX_SPLITS, 16384 // MIN_SPLIT_TOKENS)      # a single 16k request spreads out
    assert choose_num_kv_splits(programs=1, max_len=MIN_SPLIT_TOKENS - 10) == 1   # short requests are not split
    assert choose_num_kv_splits(programs=4 * NUM_SMS, max_len=16384) == 1
    s = choose_num_kv_splits(programs=32, max_len=4096)
    assert s >= 2 and 32 * s <= NUM_SMS < 32 * (s + 1)                  # one full wave, no ragged second one
    assert pick_config(16).block_h == 16 and pick_config(128).block_h == 64 and pick_config(4).block_h == 16
    assert decode_programs(32, 128) == 64 and decode_programs(3, 16) == 3           # requests x head blocks


def test_bench_arithmetic() -> None:
    # One request of 16k tokens, 16 heads, bf16: cache rows + q + out.
    assert bench_case.decode_bytes(batch=1, heads=16, ctx=16384, kv_bytes=2, q_bytes=2) == \
        16384 * 576 * 2 + 16 * 576 * 2 + 16 * 512 * 2
    assert bench_case.decode_flops(batch=2, heads=128, ctx=4096) == 2 * 2 * 128 * 4096 * (576 + 512)
    # V3 on one GPU: ~241 FLOP per cache byte.
    assert 235 < bench_case.decode_flops(1, 128, 4096) / (4096 * 576 * 2) < 245


@pytest.mark.parametrize("splits", [None, 16])
def test_separate_rope_query(device: str, splits: int | None) -> None:
    # The decode path passes the absorbed latent query and the roped query as two tensors (no concatenation):
    # the latent part in a head-major buffer, the rope part a strided view into the projected q. 16 splits over
    # short contexts leave most splits empty (never written, never read).
    args = make_case(device, [3, random.randint(20, 60)], heads=4, big_l=64, rope=16, num_q=1,
                     dtype=torch.float32, kv_dtype=torch.float32)
    q = args["q"]
    q_lat = q[..., :64].transpose(0, 1).contiguous().transpose(0, 1)         # [T, H, L] with head-major strides
    q_pe = torch.cat([torch.randn(2, 4, 40, device=device), q[..., 64:]], dim=-1)[..., 40:]
    got = mla_decode(**{**args, "q": q_lat}, q_pe=q_pe, num_kv_splits=splits)
    assert (got - mla_decode_ref(**args)).abs().max().item() <= TOL[torch.float32]
    with pytest.raises(AssertionError, match="q_pe"):
        mla_decode(**{**args, "q": q_lat}, q_pe=q_pe[..., :8].contiguous().double())


def random_tree_mask(num_q: int, b: int, device: str) -> torch.Tensor:
    """[b * num_q] int64: per request a random tree over its num_q new tokens (parents listed first, token 0 the
    root); each row's bits are its ancestors and itself."""
    rows = []
    for _ in range(b):
        bits = [1]
        for j in range(1, num_q):
            bits.append(bits[random.randrange(j)] | (1 << j))
        rows += bits
    return torch.tensor(rows, dtype=torch.int64, device=device)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tree_mask_matches_reference(device: str, splits: int | None, dtype: torch.dtype) -> None:
    """Speculative tree verification: each new token sees the prefix and its ancestors only."""
    num_q = 6
    lens = [num_q, random.randint(7, 70), random.randint(130, 200)]
    args = make_case(device, lens, heads=4, big_l=64, rope=16, num_q=num_q, dtype=dtype, kv_dtype=dtype)
    args["tree_mask"] = mask = random_tree_mask(num_q, len(lens), device)
    check(args, TOL[dtype], num_kv_splits=splits)
    # the reference: a leaf of the first request (no prefix) attends to exactly its ancestors' V rows
    slots = args["req_to_token"][args["req_pool_idx"][0], :num_q].long()
    kv = args["kv_cache"][slots].float()
    j = num_q - 1
    seen = [i for i in range(num_q) if (int(mask[j]) >> i) & 1]
    q = args["q"][j].float()
    p = torch.softmax(torch.einsum("hd,nd->hn", q, kv[seen]) * args["sm_scale"], dim=-1)
    assert torch.allclose(mla_decode_ref(**args)[j].float(), p @ kv[seen, :64], atol=TOL[dtype])


def test_chain_tree_mask_is_the_causal_mask(device: str) -> None:
    num_q = 4
    args = make_case(device, [5, 90], heads=4, big_l=64, rope=16, num_q=num_q, dtype=torch.float32,
                     kv_dtype=torch.float32)
    chain = torch.tensor([(1 << (j + 1)) - 1 for j in range(num_q)] * 2, dtype=torch.int64, device=device)
    want = mla_decode(**args)
    assert (mla_decode(**args, tree_mask=chain) - want).abs().max().item() <= 1e-6
    assert (mla_decode_ref(**args, tree_mask=chain) - mla_decode_ref(**args)).abs().max().item() == 0


# ------------------------------------------------------------------------------------------ one split, one launch
class LaunchCount:
    """Stands in for a Triton kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_split_writes_the_output_without_a_reduce(device: str, dtype: torch.dtype, monkeypatch) -> None:
    """One split: the decode kernel writes `out` itself (no reduce launch); several: one reduce launch. Both the
    reference's output, ragged lengths (a one-token request, a strided `out`), num_q 2 with a tree mask."""
    s = random.randrange(2**31)
    print(f"seed {s}")
    random.seed(s)
    torch.manual_seed(s)
    reduce = LaunchCount(md._mla_decode_reduce_kernel)
    monkeypatch.setattr(md, "_mla_decode_reduce_kernel", reduce)
    for num_q, tree in ((1, False), (2, True)):
        lens = [num_q, random.randint(2, 60), random.randint(150, 300)]
        args = make_case(device, lens, heads=16, big_l=64, rope=16, num_q=num_q, dtype=dtype, kv_dtype=dtype)
        kw = dict(tree_mask=random_tree_mask(num_q, len(lens), device)) if tree else {}
        want = mla_decode_ref(**args, **kw).float()
        for splits, launches in ((1, 0), (4, 1)):
            before = reduce.launches
            out = torch.full((len(lens) * num_q, 18, 64), float("nan"), dtype=dtype, device=device)[:, 1:17]
            got = mla_decode(**args, num_kv_splits=splits, out=out, **kw)
            assert reduce.launches - before == launches and got.data_ptr() == out.data_ptr()
            assert (got.float() - want).abs().max().item() <= TOL[dtype]
