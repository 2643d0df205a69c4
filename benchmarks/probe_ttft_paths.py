"""Which part of the request path adds to the time to first token at concurrency 1 (issue 15): one server, the
same kind of prompt sent by ids or by text, streamed or not, asking 1 or 16 new tokens, greedy or sampled;
the median time until the first chunk that carries an output token, per variant, interleaved over rounds. Text
prompts are ~285 tokens (the V2-Lite test tokenizer) and start with BOS, so after the first one each has a
one-token radix hit; "first token shared" gives id prompts the same hit.

    PYTHONPATH=$PWD python benchmarks/probe_ttft_paths.py [--port 30000] [--len 200] [--rounds 12]
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time

VARIANTS = {                       # name: (by text, stream, new tokens, temperature); "shared": ids from token 1 on
    "ids, not streamed, 1 token": (False, False, 1, 0.0),
    "ids, streamed, 16 tokens, first token shared": ("shared", True, 16, 0.0),
    "ids, streamed, 1 token": (False, True, 1, 0.0),
    "ids, streamed, 16 tokens": (False, True, 16, 0.0),
    "ids, streamed, 16 tokens, temperature 1": (False, True, 16, 1.0),
    "text, streamed, 16 tokens": (True, True, 16, 0.0),
}
WORDS = "the of and to in is that for it as with was on be by this are from at or have an they which one".split()


def first_token_s(port: int, body: dict) -> float:
    """Seconds from sending `body` to /generate until a response chunk names an output token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = None
    if not body["stream"]:
        obj = json.loads(resp.read())
        assert obj["output_ids"], obj
        first = time.perf_counter() - t0
    else:
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if first is None and line.startswith(b"data:") and line != b"data: [DONE]":
                if json.loads(line[5:]).get("output_ids"):
                    first = time.perf_counter() - t0
    conn.close()
    assert first is not None, "no output token came"
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--len", type=int, default=200, help="prompt tokens (ids) / words (text)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=100000)
    args = ap.parse_args()
    rng = random.Random(0)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds + 1):                   # round 0 warms each path up and is dropped
        for name, (text, stream, new, temp) in VARIANTS.items():
            ids = [rng.randrange(10, args.vocab) for _ in range(args.len)]
            if text == "shared":          # every prompt starts with token 1 (as text prompts with BOS): a radix hit
                ids[0] = 1
            prompt = {"text": " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(args.len // 2))} \
                if text is True else {"input_ids": ids}
            body = {**prompt, "stream": stream,
                    "sampling_params": {"max_new_tokens": new, "temperature": temp, "ignore_eos": True}}
            t = first_token_s(args.port, body)
            if r:
                times[name].append(t)
    for name, ts in times.items():
        print(f"{name:44s} median {statistics.median(ts) * 1e3:6.1f} ms   min {min(ts) * 1e3:6.1f}   "
              f"max {max(ts) * 1e3:6.1f}   ({len(ts)} requests)")


if __name__ == "__main__":
    main()
