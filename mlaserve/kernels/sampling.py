"""Seeded Gumbel-max sampling: next[b] = argmax_v(logits[b, v] + gumbel(seed[b], step[b], v)), one pass over V.

The noise comes from a counter-based hash of (seed, step, token id), so a request's draw depends only on its
own seed and step: not on the batch it shares, its row, the device, or any generator state.
Shapes: `B` rows (requests), `V` vocabulary.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The hash: 32-bit murmur3 finalizers over the words of (seed, step) then the token id. All values are held
# in int64 and stay below 2^32, so every product stays below 2^48: no overflow, no signed-shift surprises,
# and the same integers come out of torch (CPU or CUDA), the Triton interpreter and compiled Triton.
#
#   k0 = fmix(fmix(fmix(seed_lo ^ SALT0) ^ seed_hi) ^ step_lo)      row keys: once per row
#   k1 = fmix(k0 ^ step_hi ^ SALT1)
#   h  = fmix(fmix(k0 ^ (v * GOLDEN mod 2^32)) ^ k1)                 one per (row, token)
#   u  = (2 * (h >> 9) + 1) / 2^24        in (0, 1), exact in fp32;   gumbel = -log(-log(u))
#
# NOTE: the torch helpers below and the `_tl` helpers must stay the same formula; tests compare them exactly.
_M32 = 0xFFFFFFFF
_SALT0, _SALT1 = 0x243F6A88, 0x13198A2E   # digits of pi: any constants work, they only separate the words
_GOLDEN_LO, _GOLDEN_HI = 0x79B9, 0x9E37   # 0x9E3779B9 split in 16-bit halves (products stay < 2^48)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 on int64 tensors holding values in [0, 2^32); multiplications done mod 2^32 in halves."""
    h = h ^ (h >> 16)
    h = (h * 0xCA6B + (((h * 0x85EB) & 0xFFFF) << 16)) & _M32           # h * 0x85EBCA6B mod 2^32
    h = h ^ (h >> 13)
    h = (h * 0xAE35 + (((h * 0xC2B2) & 0xFFFF) << 16)) & _M32           # h * 0xC2B2AE35 mod 2^32
    return h ^ (h >> 16)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # seeds, steps: [B] int64 -> (k0, k1): [B] int64 in [0, 2^32)
    k0 = _fmix32((seeds & _M32) ^ _SALT0)
    k0 = _fmix32(k0 ^ ((seeds >> 32) & _M32))
    k0 = _fmix32(k0 ^ (steps & _M32))
    k1 = _fmix32(k0 ^ ((steps >> 32) & _M32) ^ _SALT1)
    return k0, k1


def gumbel_noise_ref(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V] float32, a pure function of (seeds[b], steps[b], v)."""
    k0, k1 = _row_keys(seeds.long(), steps.long())                         # [B]
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)   # [V]
    v_mix = (v * _GOLDEN_LO + (((v * _GOLDEN_HI) & 0xFFFF) << 16)) & _M32
    h = _fmix32(_fmix32(k0[:, None] ^ v_mix[None, :]) ^ k1[:, None])      # [B, V]
    u = ((h >> 9) * 2 + 1).float() * (1.0 / 16777216.0)                   # (0, 1), 2^-24 steps
    return -torch.log(-torch.log(u))


def gumbel_argmax_ref(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Sample one token per row by Gumbel-max (the spec of `gumbel_argmax`, and the CPU path).

    Args:
        logits: [B, V] float32, already penalised, temperature-scaled and filtered (removed tokens = -inf).
        seeds: [B] int64 per-request seeds; steps: [B] int64 per-request counters (tokens generated so far).
    Returns:
        [B] int64 ids. argmax(logits + G) with G ~ Gumbel(0, 1) i.i.d. is a draw from softmax(logits);
        ties (and all -inf rows) go to the lowest id.
    """
    noise = gumbel_noise_ref(seeds, steps, logits.shape[1])               # [B, V]
    return torch.argmax(logits.float() + noise, dim=-1)


# Greedy decoding's argmax over the vocabulary. torch's one-program-per-row reduction took 23 us for one row of
# 102,400 logits on an H200, after the decode graph and on the critical path (decode-profile-h200.md); here the
# row is cut into ARGMAX_CHUNK pieces reduced side by side, then a second launch picks among the pieces (the seeded
# sampler below ends with the same pick).
ARGMAX_CHUNK = 4096


@triton.jit
def _argmax_chunk_kernel(X, PartV, PartI, V, stride_x, chunks, BLOCK: tl.constexpr):
    # program (row, c): the largest value of X[row, c * BLOCK : (c + 1) * BLOCK] and its lowest id
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)                               # NaN counts as the largest
    top, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(PartV + row * chunks + c, top)
    tl.store(PartI + row * chunks + c, (c * BLOCK + at).to(tl.int64))


@triton.jit
def _argmax_pick_kernel(PartV, PartI, Out, chunks, BLOCK_C: tl.constexpr):
    # program row: the first chunk holding the row's largest value (its id is the lowest among the maxima)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    v = tl.load(PartV + row * chunks + offs, mask=offs < chunks, other=float("-inf"))
    _, at = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(Out + row, tl.load(PartI + row * chunks + at))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] (float, unit stride along V) -> [B] int64: each row's argmax, ties to the lowest id (an all -inf row
    gives 0), as torch.argmax; a NaN counts as +inf (torch ranks it above +inf: they differ only on a row holding
    both)."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float32, torch.float16, torch.bfloat16), \
        f"x must be a [B, V] float tensor with unit stride along V, got {tuple(x.shape)} {x.dtype} {x.stride()}"
    b, v = x.shape
    assert 0 < v < 2**31, f"V must be in [1, 2^31), got {v}"
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    block = min(ARGMAX_CHUNK, triton.next_power_of_2(v))
    chunks = triton.cdiv(v, block)
    part_v, part_i = _chunk_parts(b, chunks, x.device)
    _argmax_chunk_kernel[(b, chunks)](x, part_v, part_i, v, x.stride(0), chunks, BLOCK=block,
                                      num_warps=8 if block >= 2048 else 4)
    return _pick(part_v, part_i, out)


def _chunk_parts(b: int, chunks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-chunk (best value, its id) buffers [B, chunks] a chunk kernel fills for `_pick`."""
    return (torch.empty((b, chunks), dtype=torch.float32, device=device),
            torch.empty((b, chunks), dtype=torch.int64, device=device))


def _pick(part_v: torch.Tensor, part_i: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The second launch: out[row] = the id of the first chunk holding the row's best value."""
    b, chunks = part_v.shape
    _argmax_pick_kernel[(b,)](part_v, part_i, out, chunks, BLOCK_C=max(16, triton.next_power_of_2(chunks)),
                              num_warps=1)
    return out


def greedy_ids(logits: torch.Tensor, triton_ok: bool = True) -> torch.Tensor:
    """logits [B, V] -> [B] int64 argmax: `argmax_rows` on the GPU where `triton_ok` (the model's kernel set is
    Triton's), torch.argmax elsewhere (same ids)."""
    if triton_ok and logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1] > 0:
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


@triton.jit
def _fmix32_tl(h):
    h = h ^ (h >> 16)
    h = (h * 0xCA6B + (((h * 0x85EB) & 0xFFFF) << 16)) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xAE35 + (((h * 0xC2B2) & 0xFFFF) << 16)) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _sampling_kernel(logits_ptr, seeds_ptr, steps_ptr, PartV, PartI, V, stride_b, chunks,
                     SALT0: tl.constexpr, SALT1: tl.constexpr, GOLDEN_LO: tl.constexpr,
                     GOLDEN_HI: tl.constexpr, BLOCK_V: tl.constexpr):
    # program (row, c): the best noisy score of ids [c * BLOCK_V, (c + 1) * BLOCK_V) and its lowest id;
    # `_argmax_pick_kernel` then takes the first chunk holding the row's best
    row = tl.program_id(0)
    c = tl.program_id(1)
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    step = tl.load(steps_ptr + row).to(tl.int64)
    k0 = _fmix32_tl((seed & 0xFFFFFFFF) ^ SALT0)
    k0 = _fmix32_tl(k0 ^ ((seed >> 32) & 0xFFFFFFFF))
    k0 = _fmix32_tl(k0 ^ (step & 0xFFFFFFFF))
    k1 = _fmix32_tl(k0 ^ ((step >> 32) & 0xFFFFFFFF) ^ SALT1)
    v = c * BLOCK_V + tl.arange(0, BLOCK_V)                              # [BLOCK_V] int32
    ok = v < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_b + v, mask=ok, other=float("-inf")).to(tl.float32)
    v64 = v.to(tl.int64)
    v_mix = (v64 * GOLDEN_LO + (((v64 * GOLDEN_HI) & 0xFFFF) << 16)) & 0xFFFFFFFF
    h = _fmix32_tl(_fmix32_tl(k0 ^ v_mix) ^ k1)
    u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
    score = x - tl.log(-tl.log(u))
    score = tl.where(ok & (score == score), score, float("-inf"))       # NaN never wins; padding lanes neither
    top, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(PartV + row * chunks + c, top)
    tl.store(PartI + row * chunks + c, (c * BLOCK_V + at).to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  block_v: int | None = None) -> torch.Tensor:
    """Triton version of `gumbel_argmax_ref`: noise + argmax fused, one read of the logits, in two launches as
    `argmax_rows`: each V chunk of a row side by side, then the pick among the chunks.

    Args:
        logits: [B, V] float32, unit stride along V (the row stride may be anything).
        seeds, steps: [B] int64.
        block_v: the V chunk of one program (power of two); default min(ARGMAX_CHUNK, next_pow2(V)).
    Returns:
        [B] int64 ids, equal to `gumbel_argmax_ref` (up to float rounding of log() on near-exact ties).
    """
    assert logits.dim() == 2, f"logits must be [B, V], got shape {tuple(logits.shape)}"
    assert logits.dtype == torch.float32, f"logits must be float32, got {logits.dtype}"
    assert logits.stride(1) == 1, f"logits must have unit stride along V, got strides {logits.stride()}"
    b, v = logits.shape
    for name, t in (("seeds", seeds), ("steps", steps)):
        assert t.shape == (b,) and t.dtype == torch.int64, f"{name} must be [{b}] int64, got {tuple(t.shape)} {t.dtype}"
        assert t.device == logits.device, f"{name} is on {t.device}, logits on {logits.device}"
    assert 0 < v < 2**31, f"vocab size must be in [1, 2^31), got {v}"
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    block_v = block_v or min(ARGMAX_CHUNK, triton.next_power_of_2(v))
    assert block_v & (block_v - 1) == 0, f"block_v must be a power of two, got {block_v}"
    chunks = triton.cdiv(v, block_v)
    part_v, part_i = _chunk_parts(b, chunks, logits.device)
    _sampling_kernel[(b, chunks)](
        logits, seeds.contiguous(), steps.contiguous(), part_v, part_i, v, logits.stride(0), chunks,
        SALT0=_SALT0, SALT1=_SALT1, GOLDEN_LO=_GOLDEN_LO, GOLDEN_HI=_GOLDEN_HI, BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return _pick(part_v, part_i, out)
