"""Speculative decoding's cost and projected speedup from `bench one-batch` rows (issue 18): random weights draft
nothing the target accepts, so a run measures what a speculative step costs, not what it gains.

For each batch size with both a plain row (CUDA graphs) and a speculative row in the given `--output-file`s:
the speculative step (drafts + verify) against the plain decode step, and the speedup it would give at a given
accept length A (tokens per request per step): A x plain step / speculative step. A is measured on another model
(`--accept NAME=A`, e.g. the trained demo model's) or computed from a per-token acceptance p for the run's chain of
S drafts, each accepted only if all before it were: A = 1 + p + ... + p^S (`--acceptance p`; DeepSeek publishes
85-90% for the second token, its one MTP module; deeper drafts from the same module accept less, so p^i for them is
an upper bound). Every projected figure is labelled as a projection.

    python benchmarks/spec_projection.py one_batch.md --accept "demo (3, 1, 4), H100=3.4" --acceptance 0.85 0.9

The rows are read from the `<!-- rows: [...] -->` comments `bench one-batch` appends, each tagged with the `## `
heading above it (gpu_v3_scale.sh writes one per run: "(CUDA graphs)", "--enable-torch-compile", "--speculative-...");
plain rows are taken from a heading with "CUDA graphs" in it, else from any heading without "compile".
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_SPEC = re.compile(r"^mlaserve spec \((\d+), (\d+), (\d+)\)")


def read_rows(paths: list[str]) -> list[tuple[str, dict]]:
    """(heading, row) for every row of every file, in order."""
    out, heading = [], ""
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.startswith("## "):
                heading = line[3:].strip()
            elif line.startswith("<!-- rows: ") and line.endswith(" -->"):
                out += [(heading, row) for row in json.loads(line[len("<!-- rows: "):-len(" -->")])]
    return out


def chain_accept_length(p: float, steps: int) -> float:
    """Tokens per step of a chain of `steps` drafts, each accepted with probability p if all before it were (the
    target's own token always counts)."""
    return sum(p ** i for i in range(steps + 1))


def pairs(rows: list[tuple[str, dict]]) -> list[tuple[dict, dict]]:
    """(plain row, speculative row) per batch size, in batch-size order."""
    spec = {r["batch_size"]: r for _, r in rows if _SPEC.match(r.get("engine", ""))}
    plain_rows = [(h, r) for h, r in rows if not _SPEC.match(r.get("engine", ""))]
    graphs = [r for h, r in plain_rows if "CUDA graphs" in h] or [r for h, r in plain_rows if "compile" not in h]
    plain = {r["batch_size"]: r for r in graphs}
    return [(plain[bs], spec[bs]) for bs in sorted(spec) if bs in plain]


def table(matched: list[tuple[dict, dict]], accepts: list[tuple[str, float]], ps: list[float]) -> str:
    cols = [f"A = {a:.2f} ({name})" for name, a in accepts]
    steps = {int(_SPEC.match(s["engine"]).group(1)) for _, s in matched}
    if len(steps) > 1:
        raise ValueError(f"speculative rows of several draft counts ({sorted(steps)}): give one run's file")
    s_steps = steps.pop() if steps else 0
    for p in ps:
        cols.append(f"p = {p:.2f}: A = {chain_accept_length(p, s_steps):.2f}")
    lines = ["| bs | plain step ms | speculative step ms (drafts + verify) | x plain | accept length measured (random "
             "weights) | " + " | ".join(f"projected speedup, {c}" for c in cols) + " |",
             "|---|---|---|---|---|" + "---|" * len(cols)]
    for plain, spec in matched:
        ratio = spec["decode_step_s"] / plain["decode_step_s"]
        a_values = [a for _, a in accepts] + [chain_accept_length(p, s_steps) for p in ps]
        proj = " | ".join(f"{a / ratio:.2f}x" for a in a_values)
        accept = spec.get("accept_length", float("nan"))
        lines.append(f"| {plain['batch_size']} | {plain['decode_step_s'] * 1e3:.2f} | "
                     f"{spec['decode_step_s'] * 1e3:.2f} | {ratio:.2f}x | {accept:.2f} | {proj} |")
    return "\n".join(lines)


def _accept(text: str) -> tuple[str, float]:
    name, sep, value = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=ACCEPT_LENGTH")
    return name.strip(), float(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="`bench one-batch --output-file` files")
    ap.add_argument("--accept", type=_accept, nargs="*", default=[], metavar="NAME=A",
                    help="accept lengths measured elsewhere (tokens per request per step)")
    ap.add_argument("--acceptance", type=float, nargs="*", default=[], metavar="P",
                    help="per-token acceptance probabilities for the chain projection")
    args = ap.parse_args(argv)
    matched = pairs(read_rows(args.files))
    if not matched:
        print("error: no batch size has both a plain (CUDA graphs) row and a speculative row", file=sys.stderr)
        return 2
    print("Projected speedups are projections: the speculative step's measured cost, and an accept length not "
          "measured on these weights.\n")
    print(table(matched, args.accept, args.acceptance))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
