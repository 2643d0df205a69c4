"""A bare streaming client (asyncio sockets, no HTTP library) for the closed-loop load of `bench serving`, and the
server's own inter-token histogram over the same run: does the client or the server make the long gaps?

NUM requests of random token ids (uniform length in [INPUT * (1 - RATIO), INPUT]; uniform [OUTPUT * (1 - RATIO),
OUTPUT] new tokens, ignore_eos) go to the native streaming `/generate`, CONC at a time. Each SSE event is stamped on
arrival; ITL per token as bench serving computes it (a chunk of n tokens: n gaps of its wait / n). The server's
`inter_token_latency_seconds` histogram (needs --enable-metrics) is read before and after, and its share of gaps
above each bucket bound printed beside the client's.

    python benchmarks/probe_stream_client.py --port 30000 [--num 192 --conc 64 --input 256 --output 128]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
import urllib.request


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def itl_histogram(port: int, text: str | None = None) -> dict[float, float]:
    """Cumulative counts of the server's inter-token histogram, by upper bound in seconds ({} without metrics)."""
    if text is None:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        except OSError:
            return {}
    out = {}
    for m in re.finditer(r'inter_token_latency_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} ([0-9.e+]+)', text):
        out[float(m.group(1))] = float(m.group(2))
    return out


async def stream_one(port: int, payload: dict) -> tuple[float, list[tuple[float, int]]]:
    """POST one streamed request; (send time, [(arrival time, completion tokens so far)] per event)."""
    body = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    events, buf = [], b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size)
            await reader.readexactly(2)
        else:
            data = await reader.read(65536)
            if not data:
                break
        now = time.perf_counter()
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    meta = json.loads(line[5:]).get("meta_info") or {}
                    events.append((now, meta.get("completion_tokens", 0)))
    writer.close()
    return t0, events


async def run(args) -> dict:
    rng = random.Random(args.seed)

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - args.ratio))), n)

    reqs = [{"input_ids": [rng.randrange(10, args.vocab) for _ in range(length(args.input))],
             "sampling_params": {"max_new_tokens": length(args.output), "temperature": 0.0, "ignore_eos": True},
             "stream": True} for _ in range(args.num)]
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    ttft, tpot, itl = [], [], []
    made = 0

    async def worker() -> None:
        nonlocal made
        while not queue.empty():
            t0, events = await stream_one(args.port, queue.get_nowait())
            events = [e for e in events if e[1] > 0]
            ttft.append((events[0][0] - t0) * 1e3)
            made += events[-1][1]
            for (a, n0), (b, n1) in zip(events, events[1:]):
                if n1 > n0:
                    itl.extend([(b - a) * 1e3 / (n1 - n0)] * (n1 - n0))
            if events[-1][1] > events[0][1]:
                tpot.append((events[-1][0] - events[0][0]) * 1e3 / (events[-1][1] - events[0][1]))

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.conc)))
    dur = time.perf_counter() - t
    med = statistics.median(itl)
    return {"client": "bare asyncio", "num": args.num, "conc": args.conc, "duration_s": round(dur, 2),
            "out_tok_s": round(made / dur), "ttft_median_ms": round(statistics.median(ttft), 1),
            "tpot_median_ms": round(statistics.median(tpot), 2), "itl_median_ms": round(med, 2),
            "itl_p99_ms": round(pct(itl, 0.99), 2), "itl_p99_over_median": round(pct(itl, 0.99) / med, 2),
            "itl_mean_ms": round(statistics.mean(itl), 2), "itls": len(itl),
            "client_share_over_ms": {b: round(sum(1 for x in itl if x > b) / len(itl), 4) for b in (20, 40, 60, 80)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--num", type=int, default=192)
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--vocab", type=int, default=4096, help="token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--metrics-diff", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="only compare two saved /metrics pages (another client's run between them)")
    args = ap.parse_args()
    if args.metrics_diff:
        before, after = (itl_histogram(0, open(f).read()) for f in args.metrics_diff)
        out = {"client": "none (server histogram between two /metrics pages)"}
    else:
        before = itl_histogram(args.port)
        out = asyncio.run(run(args))
        after = itl_histogram(args.port)
    if after:
        total = after[float("inf")] - before.get(float("inf"), 0)
        out["server_itls"] = int(total)
        out["server_share_over_ms"] = {round(b * 1e3): round(1 - (after[b] - before.get(b, 0)) / total, 4)
                                       for b in sorted(after) if b != float("inf") and 0.01 <= b <= 0.1}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
