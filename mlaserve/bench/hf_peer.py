"""The peer in the same run: Hugging Face transformers' DeepseekV2/V3ForCausalLM on the same config with
random weights, greedy `generate` at the same batch and lengths (what users would otherwise run)."""
from __future__ import annotations

import time

import torch


def run_hf(model_dir: str, bs: int, input_len: int, output_len: int, dtype: str = "auto") -> dict:
    import transformers

    torch_dtype = torch.bfloat16 if dtype in ("auto", "bfloat16") else getattr(torch, dtype)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    cfg.pop("quantization_config", None) if isinstance(cfg, dict) else setattr(cfg, "quantization_config", None)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype).eval()
    ids = torch.randint(2, cfg.vocab_size, (bs, input_len), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(2)                                          # warm-up
    t1, tn = timed(1), timed(output_len)
    step = (tn - t1) / max(output_len - 1, 1)
    del model
    torch.cuda.empty_cache()
    return {"engine": f"HF transformers {transformers.__version__}", "batch_size": bs, "input_len": input_len,
            "output_len": output_len, "prefill_s": t1, "prefill_tok_s": bs * input_len / t1,
            "decode_step_s": step, "decode_tok_s": bs / step}
