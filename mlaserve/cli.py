"""`mlaserve` command line: serve | bench ... | tune ... | make-checkpoint | export-nextn | ... (imported lazily)."""
from __future__ import annotations

import importlib
import sys

from mlaserve.env import install_stack_dumps

COMMANDS = {
    "serve": ("mlaserve.server.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "make-checkpoint": ("mlaserve.tools.make_checkpoint", "create a synthetic DeepSeek checkpoint"),
    "token-map": ("mlaserve.tools.token_map", "the most frequent tokens of a corpus, for --speculative-token-map"),
    "export-nextn": ("mlaserve.tools.export_nextn", "a checkpoint's MTP layer alone (SGLang's NextN format), for "
                     "--speculative-draft-model-path"),
    "train-demo": ("mlaserve.tools.train_demo", "train the built-in demo model on this machine's Python source (GPU)"),
    "bench serving": ("mlaserve.bench.serving", "load-test an OpenAI-compatible server (ours or another)"),
    "bench accuracy": ("mlaserve.bench.accuracy", "held-out bits/byte and greedy agreement with fp32, per serving mode"),
    "bench one-batch": ("mlaserve.bench.one_batch", "prefill + decode one batch, beside the floor (and HF)"),
    "bench offline": ("mlaserve.bench.offline", "throughput over many random prompts through the Engine"),
    "bench kernels": ("mlaserve.bench.kernels", "time every Triton kernel at DeepSeek shapes (GPU)"),
    "tune fused-moe": ("mlaserve.tools.tune_fused_moe", "search fused-MoE kernel configs (GPU)"),
    "tune fp8-gemm": ("mlaserve.tools.tune_fp8_gemm", "search block-FP8 GEMM kernel configs (GPU)"),
}


def usage() -> str:
    lines = ["usage: mlaserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<18} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    install_stack_dumps()             # `kill -USR1 PID`: every thread's stack to the process's stderr
    for words in (2, 1):
        name = " ".join(argv[:words])
        if name in COMMANDS:
            module = importlib.import_module(COMMANDS[name][0])
            return module.main(argv[words:]) or 0
    print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    return 0 if argv and argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
