"""One line per `mlaserve bench serving` result: every row of DIR/serving_*.jsonl (the GPU scripts' summary), or the
last row of one FILE under LABEL.

    python3 benchmarks/serving_summary.py DIR
    python3 benchmarks/serving_summary.py --last FILE LABEL
"""
from __future__ import annotations

import glob
import json
import sys


def describe(r: dict, label: str) -> str:
    """TTFT, TPOT and per-token ITL (median / p99 and their ratio) of one result row."""
    ratio = r["p99_itl_ms"] / r["median_itl_ms"] if r["median_itl_ms"] else float("nan")
    accept = f", accept length {r['accept_length']:.2f}" if r.get("accept_length") else ""
    return (f"{label:>16} conc {r['max_concurrency']:>3}: out {r['output_throughput']:8.1f} tok/s, TTFT median "
            f"{r['median_ttft_ms']:7.1f} p99 {r['p99_ttft_ms']:7.1f} ms, TPOT median {r['median_tpot_ms']:6.2f} ms, "
            f"ITL/token median {r['median_itl_ms']:6.2f} p99 {r['p99_itl_ms']:7.2f} ms (x{ratio:.2f}), completed "
            f"{r['completed']}/{r['num_prompts']}{accept}")


def main(argv: list[str]) -> None:
    if argv[0] == "--last":
        print(describe(json.loads(open(argv[1]).read().splitlines()[-1]), argv[2]))
        return
    for f in sorted(glob.glob(argv[0] + "/serving_*.jsonl")):
        label = f.split("serving_")[1][:-6]
        for line in open(f):
            print(describe(json.loads(line), label))


if __name__ == "__main__":
    main(sys.argv[1:])
