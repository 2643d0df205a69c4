"""Summarise a py-spy speedscope profile: per thread, the frames with the most samples (inclusive), as a share of
the thread's samples. `py-spy record --format speedscope` writes the input; with `--idle` the waits count too.

    python benchmarks/pyspy_summary.py PROFILE.json [TOP] [--self]
"""
from __future__ import annotations

import collections
import json
import sys


def summarise(path: str, top: int = 40, self_only: bool = False) -> str:
    data = json.load(open(path))
    frames = data["shared"]["frames"]

    def label(i: int) -> str:
        f = frames[i]
        return f"{f['name']} {f.get('file', '').split('/')[-1]}:{f.get('line', '')}"

    out = []
    for prof in data["profiles"]:
        counts: collections.Counter[str] = collections.Counter()
        for stack in prof["samples"]:
            if not stack:
                continue
            for name in ({label(stack[-1])} if self_only else {label(i) for i in stack}):
                counts[name] += 1
        n = len(prof["samples"])
        out.append(f"== {prof['name']}: {n} samples")
        out.extend(f"{c:7d} {100 * c / max(n, 1):5.1f}%  {name}" for name, c in counts.most_common(top))
    return "\n".join(out)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--self"]
    print(summarise(args[0], int(args[1]) if len(args) > 1 else 40, "--self" in sys.argv))
