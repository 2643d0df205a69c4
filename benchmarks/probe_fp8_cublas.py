"""Block-FP8 GEMM at prefill sizes: our Triton `fp8_gemm` beside cuBLAS's block-scaled FP8 matmul (torch's
`scaled_mm` with 1x128 activation and 128x128 weight scales, CUDA >= 12.9 on Hopper), on DeepSeek-V3's shapes.

Prints per shape and M: the time of each path (quantisation of x included and apart), TFLOP/s, and the largest
error of each against `fp8_gemm_ref` relative to the reference's largest magnitude. Fresh random inputs (seed printed).
"""
import argparse

import torch
import torch.nn.functional as F

from mlaserve.bench.timing import measure_matmul_rate, time_cuda
from mlaserve.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, fp8_linear, fp8_linear_ref, get_fp8_gemm_config
from mlaserve.kernels.quant import block_quant_fp8_ref, per_token_group_quant_fp8

# (N, K): q_a+kv_a, q_b, kv_b, o_proj, dense gate_up, dense down, shared-expert gate_up, shared down
V3_SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (36864, 7168), (7168, 18432), (4096, 7168),
             (7168, 2048)]


def cublas_block_fp8(x_q, x_scale_t, w_q, w_scale_t, out_dtype=torch.bfloat16):
    """x_q [M, K] e4m3, x_scale_t [M, K/128] float32 outer-dim-major (stride (1, M)); w_q [N, K] e4m3,
    w_scale_t [K/128, N/128] (the weight's scale transposed: a view)."""
    return F.scaled_mm(x_q, w_q.t(), x_scale_t, F.ScalingType.BlockWise1x128, w_scale_t,
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def linear_sweep(ms):
    """fp8_linear whole (quantisation included), Triton GEMM against cuBLAS, per shape and M: where cuBLAS starts
    to win; M not a multiple of 4 included. Error of each against fp8_linear_ref."""
    print(f"{'N':>6} {'K':>6} {'M':>5} | {'triton us':>9} {'err':>8} | {'cublas us':>9} {'err':>8} | triton/cublas")
    for n, k in V3_SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.05
        w_q, w_s = block_quant_fp8_ref(w)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = fp8_linear_ref(x, w_q, w_s, out_dtype=torch.float32)
            big = ref.abs().max().item()
            cells = []
            for cublas in (False, True):
                try:
                    err = (fp8_linear(x, w_q, w_s, cublas=cublas, gemv=False).float() - ref).abs().max().item() / big
                    t = time_cuda(lambda: fp8_linear(x, w_q, w_s, cublas=cublas, gemv=False))
                    cells.append((t, err))
                except Exception as exc:       # noqa: BLE001  (a probe: report why cuBLAS refused the shape)
                    cells.append((float("nan"), str(exc).splitlines()[0][:100]))
            (t0, e0), (t1, e1) = cells
            e1s = f"{e1:8.1e}" if isinstance(e1, float) else e1
            print(f"{n:6d} {k:6d} {m:5d} | {t0 * 1e3:9.1f} {e0:8.1e} | {t1 * 1e3:9.1f} {e1s} | {t0 / t1:.2f}x",
                  flush=True)


def host_sweep():
    """Host time of one fp8_linear call while the GPU is busy (so the host's own cost shows): the same M every call,
    a new M every call (eager prefill: a new prompt length each step), those M again; Triton path and cuBLAS path."""
    import time
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    print(f"{'N':>6} {'K':>6} {'path':>8} | {'same M us':>9} {'new M us':>9} {'again us':>9}")
    for n, k in V3_SHAPES[:4]:
        w_q, w_s = block_quant_fp8_ref(torch.randn(n, k, device="cuda") * 0.05)
        for name, kw in (("triton", dict(cublas=False)), ("cublas", dict(cublas=True))):
            cells = []
            for ms in ([1024] * 24, list(range(1100, 1100 + 24 * 12, 12)), list(range(1100, 1100 + 24 * 12, 12))):
                xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms]
                fp8_linear(xs[0], w_q, w_s, **kw)
                torch.cuda.synchronize()
                for _ in range(30):
                    big @ big                                  # the device stays busy while the host launches
                t = time.perf_counter()
                for x in xs:
                    fp8_linear(x, w_q, w_s, **kw)
                cells.append((time.perf_counter() - t) / len(xs) * 1e6)
                torch.cuda.synchronize()
            print(f"{n:6d} {k:6d} {name:>8} | " + " ".join(f"{c:9.0f}" for c in cells), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--linear", action="store_true", help="time fp8_linear whole, Triton against cuBLAS")
    ap.add_argument("--host", action="store_true", help="host time per call, repeated and new token counts")
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else torch.seed() % 2**31
    torch.manual_seed(seed)
    if a.host:
        return host_sweep()
    if a.linear:
        print(f"seed {seed}; torch {torch.__version__} CUDA {torch.version.cuda}; {torch.cuda.get_device_name()}")
        return linear_sweep(a.m)
    rate = measure_matmul_rate(torch.float8_e4m3fn)
    print(f"seed {seed}; torch {torch.__version__} CUDA {torch.version.cuda}; {torch.cuda.get_device_name()}; "
          f"measured fp8 matmul rate {rate / 1e12:.0f} TFLOP/s")
    print(f"{'N':>6} {'K':>6} {'M':>5} | {'quant us':>8} {'triton us':>9} {'TF/s':>5} {'err':>8} | "
          f"{'scale.t us':>10} {'cublas us':>9} {'TF/s':>5} {'err':>8} | speedup(gemm)")
    for n, k in V3_SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.05
        w_q, w_s = block_quant_fp8_ref(w)
        w_st = w_s.t()
        for m in a.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_q, x_s = per_token_group_quant_fp8(x)
            ref = fp8_gemm_ref(x_q, x_s, w_q, w_s, out_dtype=torch.float32)
            big = ref.abs().max().item()
            cfg = get_fp8_gemm_config(n, k, m)
            t_q = time_cuda(lambda: per_token_group_quant_fp8(x))
            t_tr = time_cuda(lambda: fp8_gemm(x_q, x_s, w_q, w_s, config=cfg))
            e_tr = (fp8_gemm(x_q, x_s, w_q, w_s, config=cfg).float() - ref).abs().max().item() / big
            flops = 2 * m * n * k
            row = f"{n:6d} {k:6d} {m:5d} | {t_q * 1e3:8.1f} {t_tr * 1e3:9.1f} {flops / t_tr / 1e9:5.0f} {e_tr:8.1e} | "
            try:
                x_st = x_s.t().contiguous().t()
                t_t = time_cuda(lambda: x_s.t().contiguous().t())
                y = cublas_block_fp8(x_q, x_st, w_q, w_st)
                e_cb = (y.float() - ref).abs().max().item() / big
                t_cb = time_cuda(lambda: cublas_block_fp8(x_q, x_st, w_q, w_st))
                row += (f"{t_t * 1e3:10.1f} {t_cb * 1e3:9.1f} {flops / t_cb / 1e9:5.0f} {e_cb:8.1e} | "
                        f"{t_tr / t_cb:.2f}x")
            except Exception as exc:           # noqa: BLE001  (a probe: report why cuBLAS refused the shape)
                row += f"cuBLAS refused: {str(exc).splitlines()[0][:120]}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
