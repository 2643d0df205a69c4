"""The seeds' two ablation tables (issue 17) for this engine: single-query tokens/s and offline throughput, one row
per combination of torch.compile, CUDA graphs, radix cache, NextN (EAGLE chain), EP and DP attention.

Run on two H200s at concurrency 256: benchmarks/results/ablation-h200x2.md. On one GPU, `--tp 1` runs the
single-GPU rows and lists the EP / DP rows as needing two GPUs; `--tp 2` runs them all.
There is no Flashinfer-MLA column (one MLA backend here). Correctness of every combination is
tests/test_combinations.py; this only times them. Every row is expected to run (DP attention keys its decode graphs
by the size the groups agree on each step); a graph switch a server resolved off (the CPU) is shown as "resolved
off". DIR holds config.json and a tokenizer (make-checkpoint writes both).

    PYTHONPATH=$PWD python benchmarks/ablation.py --model-path DIR --tp 2 --table single offline \
        --serve-args "--load-format dummy" > benchmarks/results/ablation-h200x2.md

Each row starts `mlaserve serve` in a process of its own (once for both tables), waits for /health, measures through
the official `openai` client and stops it. `--rows` runs some of ROWS (to split a run over several device calls);
`--out` keeps the tables of the rows done so far in a file. A row that does not start is "not runnable" with the
server's last log line (e.g. the ConfigError naming the flags); a concurrency that fails (OOM, errors) says so in its
cell.
  single   one request, a fixed prompt, 256 new tokens (ignore_eos): completion tokens / end-to-end seconds, the
           median of --single-repeats requests after SINGLE_WARMUPS identical ones (see `single`)
  offline  a ThreadPool over one OpenAI client, prompts of ~760 words (~1 token each with DeepSeek's tokenizer), 460
           new tokens (ignore_eos), --prompts-per-level (2) x concurrency requests per level: (prompt + completion
           tokens) / wall seconds (the seeds' [8]), and the mean per request of completion tokens / its seconds ([9]);
           the server's default --max-running-requests unless --serve-args sets it
With `--plot FILE.png` (matplotlib) it also charts every runnable row as bars: single-query TPS@1, offline throughput
and per-request throughput at each concurrency. `--points` keeps the chart's points; `--plot-from` charts saved ones
(a run split over device calls, or a device without matplotlib; a row measured again in a later file keeps the later
figure at each concurrency).
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx
import openai

from mlaserve.bench.plot import BarPanel, draw_bars, missing_matplotlib
from mlaserve.bench.serving import WORDS

QUERY = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test."
SINGLE_WARMUPS = 2        # a prefill of the prompt, then a radix hit of it (`single`)
COLUMNS = ("Torch Compile", "Cuda Graph", "Radix Cache", "Next-N", "EP-MoE", "DP-Attn")


class Row(NamedTuple):
    compile: bool
    graph: bool
    radix: bool
    nextn: bool
    ep: bool
    dp: bool

    def flags(self, tp: int) -> list[str]:
        f = [f"--tp-size {tp}"] if tp > 1 else []
        f += ["--enable-torch-compile"] if self.compile else []
        f += [] if self.graph else ["--disable-cuda-graph"]
        f += [] if self.radix else ["--disable-radix-cache"]
        f += ["--speculative-algorithm EAGLE"] if self.nextn else []
        f += [f"--ep-size {tp}"] if self.ep else []
        f += [f"--enable-dp-attention --dp-size {tp}"] if self.dp else []
        return shlex.split(" ".join(f))

    def label(self) -> str:
        """The row's switches that are on, for a chart legend."""
        names = ("compile", "graph", "radix", "nextn", "ep", "dp")
        return " + ".join(n for n, v in zip(names, self) if v) or "none"

    def cells(self, info: dict | None = None) -> list[str]:
        """The row's switches; a graph switch the server resolved off (e.g. on the CPU) says so."""
        cells = ["✅" if v else "➖" for v in self]
        if self.graph and (info or {}).get("disable_cuda_graph"):
            cells[1] = "➖ (resolved off)"
        return cells


# both of the seeds' tables' rows without their Flashinfer-MLA variants (duplicates dropped; the single-query table
# has radix on in the NextN + EP + DP row, the offline one off: both kept), then NextN rows the seeds could not run
R = Row
ROWS = [R(1, 1, 1, 0, 0, 0), R(1, 1, 1, 0, 0, 1), R(1, 1, 1, 0, 1, 1), R(1, 1, 1, 0, 1, 0), R(1, 0, 1, 0, 1, 0),
        R(0, 1, 1, 0, 1, 0), R(0, 0, 0, 1, 1, 0), R(0, 1, 0, 1, 1, 0), R(1, 1, 0, 1, 1, 0), R(0, 1, 1, 0, 1, 1),
        R(0, 1, 1, 1, 1, 1), R(0, 1, 0, 1, 1, 1), R(0, 0, 0, 1, 0, 1),
        R(0, 1, 1, 1, 0, 0), R(1, 1, 1, 1, 0, 0), R(1, 1, 1, 1, 1, 0)]


class Server:
    """`mlaserve serve` with a row's flags on `port`; `error` is its last log line when it did not come up."""

    def __init__(self, args: argparse.Namespace, flags: list[str], name: str = "row"):
        keep = args.server_logs is not None
        cmd = [sys.executable, "-m", "mlaserve.cli", "serve", "--model-path", args.model_path, "--port",
               str(args.port), "--log-level", "info" if keep else "warning", *flags, *shlex.split(args.serve_args)]
        # a file, not a pipe: a full pipe would block the server
        self.log = open(Path(args.server_logs) / f"{name}.log", "w+") if keep else tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self.url, self.error, self.model, self.info = f"http://127.0.0.1:{args.port}", None, "", {}
        deadline = time.monotonic() + args.start_timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.model = self.client().models.list().data[0].id
                    self.info = httpx.get(f"{self.url}/get_server_info", timeout=10).json()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        self.log.seek(0)
        lines = [x.strip() for x in self.log.read().replace("\r", "\n").splitlines() if x.strip()]
        last = lines[-1].split(" ERROR ")[-1].replace("|", "/") if lines else None
        self.error = last or f"not healthy after {args.start_timeout} s"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=3600,
                             http_client=httpx.Client(limits=httpx.Limits(max_connections=None)))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[int, int, float]:
    """(prompt tokens, completion tokens, seconds) of one greedy completion."""
    t0 = time.perf_counter()
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.usage.prompt_tokens, r.usage.completion_tokens, time.perf_counter() - t0


def single(server: Server, args: argparse.Namespace) -> float:
    """Median completion tokens / second of the timed requests, after SINGLE_WARMUPS identical ones.

    NOTE: with the radix cache the first request prefills the prompt and every later one is a cache hit of all
    but its last token (a 1-token extend over a cached prefix): a different path, whose Triton kernels (mla_prefill's
    prefix attention and merge, its causal part with an fp32 output) compile on its first use
    (benchmarks/probe_first_launch.py). So the warm-ups are the timed request itself, twice: one of each path."""
    c = server.client()
    for _ in range(SINGLE_WARMUPS):
        complete(c, server.model, QUERY, args.single_new)
    runs = [complete(c, server.model, QUERY, args.single_new) for _ in range(args.single_repeats)]
    return statistics.median(n / dt for _, n, dt in runs)


def offline(server: Server, args: argparse.Namespace, concurrency: int) -> tuple[float, float] | str:
    """(throughput p + d, mean per-request d throughput) in tokens / s, or why the level failed."""
    rng = random.Random(args.seed)
    n = max(concurrency, round(args.prompts_per_level * concurrency))
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(n)]
    client = server.client()                                # httpx's pool is thread-safe
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(pool.map(lambda p: complete(client, server.model, p, args.output_len), prompts))
    except openai.OpenAIError as e:
        return f"failed: {type(e).__name__}"
    wall = time.perf_counter() - t0
    return sum(p + n for p, n, _ in done) / wall, sum(n / dt for _, n, dt in done) / len(done)


# chart -> row label -> (concurrency, tokens / s) points, filled as the tables run
Points = dict[str, dict[str, list[tuple[float, float]]]]


def head_cells(table: str) -> tuple[list[str], list[str]]:
    """The columns before and after the switches."""
    if table == "single":
        return ["Runnable", "TPS@1"], []
    return ["Runnable"], ["Client Concurrency", "Avg Throughput (p+d, token/s)", "Per-req Throughput (d, token/s)",
                          "Total Req"]


def measure_row(args: argparse.Namespace, row: Row, points: Points) -> dict[str, list[str]]:
    """One server for the row, every table measured on it: table -> the row's cells."""
    out: dict[str, list[str]] = {}
    if (row.ep or row.dp) and args.tp < 2:
        for table in args.table:
            head, tail = head_cells(table)
            out[table] = ["needs --tp 2 (two GPUs)"] + ["N/A"] * (len(head) - 1) + row.cells() + ["N/A"] * len(tail)
        return out
    t0 = time.monotonic()
    server = Server(args, row.flags(args.tp), f"row{ROWS.index(row)}")
    started = time.monotonic() - t0
    try:
        for table in args.table:
            head, tail = head_cells(table)
            if server.error:
                out[table] = [f"❌ {server.error}"] + ["N/A"] * (len(head) - 1) + row.cells() + ["N/A"] * len(tail)
            elif table == "single":
                tps = single(server, args)
                points["per_req"].setdefault(row.label(), []).append((1, tps))
                out[table] = [f"✅ ({started:.0f} s to start)", f"{tps:.1f}", *row.cells(server.info)]
            else:
                levels = [offline(server, args, c) for c in args.concurrency]
                for c, level in zip(args.concurrency, levels):
                    if not isinstance(level, str):
                        points["throughput"].setdefault(row.label(), []).append((c, level[0]))
                        points["per_req"].setdefault(row.label(), []).append((c, level[1]))
                shown = [(x, "N/A") if isinstance(x, str) else (f"{x[0]:.2f}", f"{x[1]:.2f}") for x in levels]
                n = [max(c, round(args.prompts_per_level * c)) for c in args.concurrency]
                out[table] = ["✅", *row.cells(server.info), "<br>".join(map(str, args.concurrency)),
                              "<br>".join(a for a, _ in shown), "<br>".join(b for _, b in shown),
                              "<br>".join(map(str, n))]
    finally:
        server.stop()
    return out


def render(args: argparse.Namespace, done: dict[str, list[list[str]]]) -> str:
    """The tables of the rows measured so far, in the seeds' format."""
    lines = [f"model {args.model_path}, tp {args.tp}, serve args {args.serve_args!r}, seed {args.seed}, rows "
             f"{' '.join(map(str, args.rows))} of {len(ROWS)}"]
    for table in args.table:
        head, tail = head_cells(table)
        lines += ["", f"### {'Single query' if table == 'single' else 'Offline batch'} performance", "",
                  "| " + " | ".join([*head, *COLUMNS, *tail]) + " |",
                  "|" + "---|" * (len(head) + len(COLUMNS) + len(tail))]
        lines += ["| " + " | ".join(cells) + " |" for cells in done[table]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="DIR (config.json and a tokenizer); needed unless --plot-from")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2), help="GPUs per server (EP / DP rows need 2)")
    ap.add_argument("--table", nargs="+", default=["single", "offline"], choices=("single", "offline"))
    ap.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))),
                    help=f"indices into ROWS (0-{len(ROWS) - 1}) to run, in this order (default: all)")
    ap.add_argument("--serve-args", default="", help="extra `mlaserve serve` flags for every row")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--server-logs", default=None, metavar="DIR",
                    help="keep each row's server log (level info) as DIR/rowN.log (default: a temporary file)")
    ap.add_argument("--start-timeout", type=float, default=1200.0)
    ap.add_argument("--single-new", type=int, default=256)
    ap.add_argument("--single-repeats", type=int, default=3, help="timed single-query requests (the median is shown)")
    ap.add_argument("--input-len", type=int, default=760)
    ap.add_argument("--output-len", type=int, default=460)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 256, 512, 768])
    ap.add_argument("--prompts-per-level", type=float, default=2.0,
                    help="requests per offline level, as a multiple of its concurrency (the seeds: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, metavar="FILE.md",
                    help="also write the tables here, rewritten after every row (a cut-off run keeps its rows)")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="chart the runnable rows against concurrency")
    ap.add_argument("--title", default=None, help="the chart's title (default: model path and tp)")
    ap.add_argument("--points", default=None, metavar="FILE.json",
                    help="also write the chart's points here, rewritten after every row (to chart them elsewhere)")
    ap.add_argument("--plot-from", nargs="+", default=None, metavar="FILE.json",
                    help="measure nothing: chart the points of these --points files (e.g. a run's halves) to --plot")
    args = ap.parse_args(argv)
    if (args.plot or args.plot_from) and missing_matplotlib():
        print(f"error: {missing_matplotlib()}", file=sys.stderr)
        return 2
    if args.plot_from:
        if not args.plot:
            print("error: --plot-from needs --plot FILE.png", file=sys.stderr)
            return 2
        # NOTE: a row measured again (a later call) replaces its earlier point at the same concurrency
        latest: dict[str, dict[str, dict[float, float]]] = {"throughput": {}, "per_req": {}}
        for f in args.plot_from:
            for chart, rows in json.loads(Path(f).read_text()).items():
                for label, pts in rows.items():
                    latest[chart].setdefault(label, {}).update((x, y) for x, y in pts)
        merged: Points = {chart: {label: list(pts.items()) for label, pts in rows.items()}
                          for chart, rows in latest.items()}
        plot(args, merged)
        return 0
    if not args.model_path:
        print("error: --model-path is required (unless --plot-from)", file=sys.stderr)
        return 2
    bad = [i for i in args.rows if not 0 <= i < len(ROWS)]
    if bad:
        print(f"error: --rows {' '.join(map(str, bad))}: indices are 0-{len(ROWS) - 1}", file=sys.stderr)
        return 2
    points: Points = {"throughput": {}, "per_req": {}}
    done: dict[str, list[list[str]]] = {t: [] for t in args.table}
    for i in args.rows:
        for table, cells in measure_row(args, ROWS[i], points).items():
            done[table].append(cells)
        print(f"row {i} ({ROWS[i].label()}): " + "; ".join(f"{t}: {' | '.join(c[:2])}" for t, c in
                                                          ((t, done[t][-1]) for t in args.table)),
              file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(render(args, done))
        if args.points:
            Path(args.points).write_text(json.dumps(points))
    print(render(args, done), end="")
    if args.plot:
        plot(args, points)
    return 0


def plot(args: argparse.Namespace, points: Points) -> None:
    """Bars, a group per row: single-query TPS@1, then offline and per-request throughput per concurrency."""
    rows = list(dict.fromkeys([*points["per_req"], *points["throughput"]]))

    def series(chart: str, levels: list[float]) -> dict[str, list[float | None]]:
        at = {r: dict(points[chart].get(r, [])) for r in rows}
        return {f"concurrency {c:g}": [at[r].get(c) for r in rows] for c in levels}

    levels = sorted({c for pts in points["throughput"].values() for c, _ in pts})
    single = {r: dict(points["per_req"].get(r, [])).get(1) for r in rows}
    panels = [BarPanel("single query (TPS@1)", "tokens / s", rows, {"concurrency 1": [single[r] for r in rows]}),
              BarPanel("offline throughput (p + d)", "tokens / s", rows, series("throughput", levels)),
              BarPanel("per-request throughput (d)", "tokens / s", rows, series("per_req", levels))]
    # a table not run (e.g. --table offline) leaves its panel empty: draw only panels with a bar
    panels = [p for p in panels if any(v is not None for vs in p.series.values() for v in vs)]
    default = (f"ablation: {', '.join(Path(f).stem for f in args.plot_from)}" if args.plot_from
               else f"ablation: {args.model_path}, tp {args.tp}")
    draw_bars(panels, args.plot, args.title or default)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
