"""One line per `mlaserve bench serving` result in DIR/serving_*.jsonl (the GPU scripts' summary).

    python3 benchmarks/serving_summary.py DIR
"""
from __future__ import annotations

import glob
import json
import sys


def main(out: str) -> None:
    for f in sorted(glob.glob(out + "/serving_*.jsonl")):
        label = f.split("serving_")[1][:-6]
        for line in open(f):
            r = json.loads(line)
            accept = f", accept length {r['accept_length']:.2f}" if r.get("accept_length") else ""
            print(f"{label:>10} conc {r['max_concurrency']:>3}: out {r['output_throughput']:8.1f} tok/s, "
                  f"median TTFT {r['median_ttft_ms']:7.1f} ms, median TPOT {r['median_tpot_ms']:6.3f} ms, "
                  f"p99 ITL {r['p99_itl_ms']:7.1f} ms, completed {r['completed']}/{r['num_prompts']}{accept}")


if __name__ == "__main__":
    main(sys.argv[1])
