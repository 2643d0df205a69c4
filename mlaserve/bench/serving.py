"""`mlaserve bench serving`: a load generator for any OpenAI-compatible server (flags as SGLang's bench_serving).

Sends random prompts at a Poisson rate, streams every answer and reports TTFT, TPOT, ITL, E2E latency and throughput.
ITL is per generated token on the native backend (`/generate` streams the completion token count: a chunk that
carries k tokens k gaps of 1/k of its wait each), per content chunk on the OpenAI backends (their chunks carry no
count). Several --max-concurrency levels run in turn, each a report and a JSON line; --plot charts them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
import numpy as np
from tqdm import tqdm

ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions", "mlaserve": "/generate"}
REQUEST_TIMEOUT_S = 6 * 3600.0
MAX_PRINTED_ERRORS = 5
# Common English words: with DeepSeek's tokenizer each " word" is one token, so n words ~ n prompt tokens.
WORDS = (
    "the of and to in is for that on with as it was by at from be this are have or not an which but all "
    "one can will more about time there their when would what up out people year new some could them into "
    "other than only its also over after first two work way well even because any these most day state data "
    "model river light city water music paper garden window market story number system problem question"
).split()


class BenchRequest(NamedTuple):
    prompt: str
    prompt_len: int  # tokens we believe we send (exact with --tokenizer, else word count)
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first non-empty content chunk
    latency: float = 0.0  # end-to-end seconds
    # one gap per output token after the first chunk's: a chunk of k tokens gives k gaps of (its wait) / k (the
    # OpenAI backends count one token per content chunk, `ITL_UNITS`)
    itl: list[float] = field(default_factory=list)


ITL_UNITS = {"mlaserve": "token", "openai": "chunk", "openai-chat": "chunk"}   # what one ITL sample spans
# One client process keeps up with about this many streams at once (~6,000 events / s on one core; a client that
# falls behind reads several tokens at once and reports their gaps as ~0: benchmarks/results/dp-ep-h200x2.md)
CLIENT_STREAMS_PER_PROCESS = 128
PROCESS_START_S = 3.0       # how long before the common start the client processes are spawned


# ----------------------------------------------------------------------------- dataset


def sample_lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> np.ndarray:
    """n integer lengths uniform in [ratio * length, length], never below 1."""
    low = max(1, int(ratio * length))
    return rng.integers(low, max(low, length) + 1, size=n)


def word_prompt(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))


def token_prompt(tok: Any, rng: np.random.Generator, n: int, allowed: np.ndarray) -> tuple[str, int]:
    """Text that re-encodes to exactly n tokens (up to a few fix-up rounds); returns (text, its token count)."""
    ids = rng.choice(allowed, size=n).tolist()
    for _ in range(10):
        text = tok.decode(ids)
        got = tok.encode(text, add_bos=False)
        if len(got) == n:
            return text, n
        # NOTE: decode -> encode may merge or split tokens; trim or top up and try again
        ids = got[:n] if len(got) > n else got + rng.choice(allowed, size=n - len(got)).tolist()
    text = tok.decode(ids)
    return text, len(tok.encode(text, add_bos=False))


def plain_token_ids(tok: Any) -> np.ndarray:
    """Ids safe to put in a random prompt: not added/special, and decoding alone to valid, non-empty text."""
    # NOTE: byte-level pieces of a multi-byte character decode to U+FFFD and make decode -> encode drift
    added = set(getattr(getattr(tok, "backend", None), "get_added_tokens_decoder", dict)())
    texts = (tok.decode([i]) for i in range(tok.vocab_size))
    return np.array([i for i, t in enumerate(texts) if t and "\ufffd" not in t and i not in added], dtype=np.int64)


def random_requests(args: argparse.Namespace, tok: Any | None) -> list[BenchRequest]:
    rng = np.random.default_rng(args.seed)
    in_lens = sample_lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    out_lens = sample_lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    allowed = plain_token_ids(tok) if tok is not None else None
    reqs = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        prompt, n = token_prompt(tok, rng, n_in, allowed) if tok is not None else (word_prompt(rng, n_in), n_in)
        reqs.append(BenchRequest(prompt, n, n_out))
    return reqs


# ----------------------------------------------------------------------------- one streamed request


def build_payload(backend: str, model: str | None, req: BenchRequest) -> dict[str, Any]:
    if backend == "mlaserve":
        params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}
        return {"text": req.prompt, "sampling_params": params, "stream": True}
    body: dict[str, Any] = {
        "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if model is not None:
        body["model"] = model
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


class StreamState:
    """What one SSE stream has said so far: text (for the cumulative native format) and token counts."""

    def __init__(self) -> None:
        self.text = ""
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None

    def feed(self, backend: str, obj: dict[str, Any]) -> int:
        """Read one parsed chunk; the output tokens it carries (0: no new output; OpenAI backends: 1 per content
        chunk, their chunks carry no count)."""
        if backend == "mlaserve":
            return self._feed_native(obj)
        usage = obj.get("usage") or {}
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        choice = (obj.get("choices") or [{}])[0]
        if backend == "openai-chat":
            delta = choice.get("delta") or {}
            return int(bool(delta.get("content") or delta.get("reasoning_content")))
        return int(bool(choice.get("text")))

    def _feed_native(self, obj: dict[str, Any]) -> int:
        # native stream (SGLang /generate format): "text" is cumulative, counts are in "meta_info"
        meta = obj.get("meta_info") or {}
        before = self.completion_tokens or 0
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        self.completion_tokens = meta.get("completion_tokens", self.completion_tokens)
        text = obj.get("text") or ""
        new = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text if text.startswith(self.text) else self.text + text
        if "completion_tokens" in meta:       # the server's count: a chunk may carry several tokens (or none)
            return max(int(self.completion_tokens or 0) - before, 0)
        return int(bool(new))


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """One SSE line -> its JSON object; None for blanks, comments, non-data fields and `[DONE]`."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return None
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        raise ValueError(f"malformed SSE data: {data[:120]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"malformed SSE data: {data[:120]!r}")
    if obj.get("error"):
        raise ValueError(f"error in stream: {json.dumps(obj['error'])[:300]}")
    return obj


async def send_request(
    client: httpx.AsyncClient, url: str, backend: str, model: str | None, req: BenchRequest, headers: dict[str, str]
) -> RequestResult:
    """Stream one request and time it; every failure is caught and returned as `success=False`."""
    res, state = RequestResult(prompt_len=req.prompt_len), StreamState()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=build_payload(backend, model, req), headers=headers) as resp:
            if resp.status_code >= 400:
                body = (await resp.aread()).decode(errors="replace").strip()
                raise ValueError(f"HTTP {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                obj = parse_sse_line(line)
                new = state.feed(backend, obj) if obj is not None else 0
                if not new:
                    continue
                now = time.perf_counter()
                if res.output_tokens == 0:
                    res.ttft = now - start    # NOTE: the first chunk's other tokens came with it: no gap of theirs
                else:
                    res.itl.extend([(now - last) / new] * new)
                last, res.output_tokens = now, res.output_tokens + new
        res.latency = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - a benchmark reports failures, it never crashes on them
        res.error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        return res
    if res.output_tokens == 0:
        res.error = "stream ended without any content"
        return res
    res.output_tokens = state.completion_tokens or res.output_tokens
    res.prompt_len = state.prompt_tokens or req.prompt_len
    res.success = True
    return res


async def fetch_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str | None:
    """First model id served at `GET /v1/models`, or None (with a warning) when that fails."""
    try:
        resp = await client.get(base_url + "/v1/models", headers=headers, timeout=30.0)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except Exception as e:  # noqa: BLE001
        print(f"warning: could not read the model from {base_url}/v1/models ({type(e).__name__}: {e}); "
              "sending requests without a model", file=sys.stderr)
        return None


async def fetch_spec_counts(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> tuple[int, int] | None:
    """(verify steps, tokens they produced) from `GET /get_server_info` of a server decoding speculatively, else
    None (no speculation, or a server without those counters)."""
    try:
        resp = await client.get(base_url + "/get_server_info", headers=headers, timeout=30.0)
        info = resp.json()
    except Exception:  # noqa: BLE001 - the figure is optional
        return None
    if not info.get("speculative_algorithm") or "spec_verify_steps" not in info:
        return None
    return int(info["spec_verify_steps"]), int(info["spec_tokens"])


# ----------------------------------------------------------------------------- load


def _client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=60.0)
    # NOTE: trust_env=False so a proxy in the environment never sits between the benchmark and the server
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _send_all(client: httpx.AsyncClient, args: argparse.Namespace, model: str | None,
                    reqs: list[BenchRequest], concurrency: int | None, rate: float, seed: int,
                    show: bool) -> list[RequestResult]:
    """Launch `reqs` at Poisson arrival times of `rate` req/s, at most `concurrency` in flight."""
    url, headers = args.base_url + ENDPOINTS[args.backend], _headers(args)
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(req: BenchRequest) -> RequestResult:
        if sem is None:
            return await send_request(client, url, args.backend, model, req, headers)
        async with sem:
            return await send_request(client, url, args.backend, model, req, headers)

    rng = np.random.default_rng(seed)
    bar = tqdm(total=len(reqs), disable=not show, desc="requests")
    tasks = []
    for i, req in enumerate(reqs):
        if i > 0 and math.isfinite(rate):
            await asyncio.sleep(rng.exponential(1.0 / rate))                  # Poisson arrivals
        tasks.append(asyncio.create_task(one(req)))
        tasks[-1].add_done_callback(lambda _: bar.update(1))
    results = list(await asyncio.gather(*tasks))
    bar.close()
    return results


def client_processes(args: argparse.Namespace) -> int:
    """--client-processes, or auto: one process streams about 6,000 events / s (one core, measured against a fake
    server on this project's CI machine), so one per CLIENT_STREAMS_PER_PROCESS requests in flight, up to a quarter
    of the cores."""
    if args.client_processes:
        return args.client_processes
    if not args.max_concurrency:
        return 1
    most = max(1, (os.cpu_count() or 1) // 4)
    return max(1, min(most, math.ceil(args.max_concurrency / CLIENT_STREAMS_PER_PROCESS)))


def _shares(total: int | None, parts: int) -> list[int | None]:
    if total is None:
        return [None] * parts
    return [total // parts + (k < total % parts) for k in range(parts)]


def _worker(args: argparse.Namespace, model: str | None, reqs: list[BenchRequest], concurrency: int | None,
            rate: float, seed: int, start_at: float) -> tuple[list[RequestResult], float]:
    """One client process: waits for the common start time, sends its share; (results, its end time)."""
    async def go() -> list[RequestResult]:
        async with _client(args) as client:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await _send_all(client, args, model, reqs, concurrency, rate, seed, show=False)

    results = asyncio.run(go())
    return results, time.time()


async def run_load(args: argparse.Namespace, reqs: list[BenchRequest]
                   ) -> tuple[list[RequestResult], float, str | None, float | None]:
    """Warm up, then launch every request at Poisson arrival times; returns (results, duration s, model, accept
    length: tokens per verify step during the run when the server decodes speculatively, else None).

    With several client processes (`client_processes`) each sends every P-th request at 1/P of the rate and of the
    concurrency, all from one start time; the duration runs from it to the last process's end."""
    headers = _headers(args)
    procs = min(client_processes(args), len(reqs))
    async with _client(args) as client:
        model = args.model or await fetch_model(client, args.base_url, headers)
        if args.warmup_requests > 0 and reqs:
            warm = await _send_all(client, args, model, [reqs[0]] * args.warmup_requests, None, math.inf, 0, False)
            failed = [r.error for r in warm if not r.success]
            note = f" (first error: {failed[0]})" if failed else ""
            print(f"warm-up: {len(warm) - len(failed)}/{len(warm)} requests succeeded{note}", file=sys.stderr)
        spec_before = await fetch_spec_counts(client, args.base_url, headers)
        if procs <= 1:
            start = time.perf_counter()
            results = await _send_all(client, args, model, reqs, args.max_concurrency, args.request_rate,
                                      args.seed + 1, show=not args.disable_tqdm)
            duration = time.perf_counter() - start
        else:
            results, duration = await asyncio.get_running_loop().run_in_executor(
                None, _run_processes, args, model, reqs, procs)
        accept = None
        spec_after = await fetch_spec_counts(client, args.base_url, headers) if spec_before else None
        if spec_before and spec_after and spec_after[0] > spec_before[0]:
            accept = (spec_after[1] - spec_before[1]) / (spec_after[0] - spec_before[0])
    return results, duration, model, accept


def _run_processes(args: argparse.Namespace, model: str | None, reqs: list[BenchRequest],
                   procs: int) -> tuple[list[RequestResult], float]:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    rate = args.request_rate / procs
    start_at = time.time() + PROCESS_START_S                    # the processes start (import) before it
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(_worker, args, model, reqs[k::procs], c, rate, args.seed + 1 + k, start_at)
                for k, c in enumerate(_shares(args.max_concurrency, procs))]
        done = [f.result() for f in futs]
    results: list[RequestResult] = [None] * len(reqs)           # type: ignore[list-item]
    for k, (part, _) in enumerate(done):
        results[k::procs] = part
    return results, max(end for _, end in done) - start_at


# ----------------------------------------------------------------------------- report


def stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    """mean / median / std / p99 of `values_s` in milliseconds, keyed like `mean_ttft_ms`; None when empty."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    fns = {"mean": np.mean, "median": np.median, "std": np.std, "p99": lambda x: np.percentile(x, 99)}
    return {f"{k}_{name}_ms": (float(f(ms)) if ms.size else None) for k, f in fns.items()}


def summarize(results: list[RequestResult], duration: float, backend: str = "mlaserve") -> dict[str, Any]:
    ok = [r for r in results if r.success]
    dur = max(duration, 1e-9)
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur, "input_throughput": n_in / dur,
        "output_throughput": n_out / dur, "total_throughput": (n_in + n_out) / dur,
        "concurrency": sum(r.latency for r in ok) / dur, "itl_unit": ITL_UNITS[backend],
    }
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out |= stats("ttft", [r.ttft for r in ok]) | stats("tpot", tpots)
    out |= stats("itl", [x for r in ok for x in r.itl]) | stats("e2e_latency", [r.latency for r in ok])
    errors = Counter(r.error for r in results if not r.success)
    out["errors"] = [f"{n} x {msg}" for msg, n in errors.most_common(MAX_PRINTED_ERRORS)]
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def print_report(m: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [
        ("Backend", args.backend), ("Request rate (req/s)", args.request_rate),
        ("Max concurrency", args.max_concurrency or "unlimited"),
        ("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
        ("Duration (s)", m["duration"]), ("Total input tokens", m["total_input_tokens"]),
        ("Total output tokens", m["total_output_tokens"]), ("Request throughput (req/s)", m["request_throughput"]),
        ("Input throughput (tok/s)", m["input_throughput"]), ("Output throughput (tok/s)", m["output_throughput"]),
        ("Total throughput (tok/s)", m["total_throughput"]), ("Concurrency", m["concurrency"]),
        ("Client processes", m.get("client_processes", 1)),
    ]
    if m.get("accept_length") is not None:
        rows.append(("Accept length (tokens / verify step)", m["accept_length"]))
    print(f"{' serving benchmark ':=^56}")
    print("\n".join(f"{label:<40}{_fmt(v):>16}" for label, v in rows))
    itl = f"ITL per {m.get('itl_unit', 'token')}"
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", itl), ("e2e_latency", "E2E latency")):
        print(f"{' ' + title + ' (ms) ':-^56}")
        print("\n".join(f"{k:<40}{_fmt(m[f'{k}_{name}_ms']):>16}" for k in ("mean", "median", "std", "p99")))
    print("=" * 56)
    if m["errors"]:
        print("errors (most frequent first):\n" + "\n".join(f"  {e}" for e in m["errors"]))


def record(m: dict[str, Any], args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    """The JSON line for --output-file: metrics plus the arguments (infinite rate written as "inf")."""
    keys = ("backend", "base_url", "dataset_name", "random_input_len", "random_output_len", "random_range_ratio",
            "num_prompts", "max_concurrency", "seed", "tokenizer", "warmup_requests")
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": model, "request_rate": rate,
            **{k: getattr(args, k) for k in keys}, **m}


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlaserve bench serving", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default=None, help="server host (default 127.0.0.1; not with --base-url)")
    p.add_argument("--port", type=int, default=None, help="server port (default 30000; not with --base-url)")
    p.add_argument("--backend", choices=[*ENDPOINTS, "sglang"], default="openai",
                   help="openai-chat: /v1/chat/completions, openai: /v1/completions, mlaserve: native /generate; "
                        "sglang: the same native protocol (SGLang's name for it: the seeds' bench_serving lines run "
                        "as written, against this server or an SGLang one)")
    p.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [ratio * len, len]")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals; inf = all at once")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=None,
                   help="most requests in flight at once; several values run one after another (e.g. 1 16 64)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory: prompts of exact token lengths")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--output-file", default=None, help="append one JSON line per run")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--client-processes", type=int, default=None,
                   help="processes sending the requests (default: one per 128 of --max-concurrency, up to a quarter "
                        "of the cores): one Python process streams ~6,000 events / s")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="chart throughput, TTFT and TPOT / ITL percentiles against concurrency (needs matplotlib)")
    args = p.parse_args(argv)
    if args.base_url and (args.host is not None or args.port is not None):
        p.error("--host / --port: --base-url names the server already; give one or the other")
    args.host = "127.0.0.1" if args.host is None else args.host
    args.port = 30000 if args.port is None else args.port
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.backend == "sglang":
        args.backend = "mlaserve"                # one protocol, two names
    if args.request_rate <= 0 or args.num_prompts < 1 or min(args.max_concurrency or [1]) < 1 \
            or (args.client_processes is not None and args.client_processes < 1):
        p.error("--request-rate, --num-prompts, --max-concurrency and --client-processes must be positive")
    return args


def levels(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One namespace per --max-concurrency value (one int each), in the order given; the seed moves on per level
    so a later level does not find the earlier one's prompts in the server's prefix cache."""
    values = args.max_concurrency or [None]
    return [argparse.Namespace(**(vars(args) | {"max_concurrency": c, "seed": args.seed + 1000 * i}))
            for i, c in enumerate(values)]


def raise_fd_limit() -> None:
    """Every in-flight request holds a socket: lift the soft open-file limit to the hard one."""
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str]) -> int:
    """Run the benchmark; exit code 0 when at least one request succeeded, else 1."""
    args = parse_args(argv)
    tok = None
    if args.tokenizer:
        from mlaserve.tokenizer import load_tokenizer

        try:
            tok = load_tokenizer(args.tokenizer)
        except (OSError, ValueError) as e:
            print(f"error: cannot load tokenizer from {args.tokenizer}: {e}", file=sys.stderr)
            return 1
    if args.plot:
        from mlaserve.bench.plot import missing_matplotlib

        missing = missing_matplotlib()
        if missing:
            print(f"error: {missing}", file=sys.stderr)
            return 2
    raise_fd_limit()
    records, completed = [], 0
    for run_args in levels(args):
        results, duration, model, accept = asyncio.run(run_load(run_args, random_requests(run_args, tok)))
        procs = min(client_processes(run_args), run_args.num_prompts)
        metrics = summarize(results, duration, args.backend) | {"accept_length": accept, "client_processes": procs}
        print_report(metrics, run_args)
        records.append(record(metrics, run_args, model))
        completed += metrics["completed"]
        if args.output_file:
            with open(args.output_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(records[-1]) + "\n")
    if args.plot:
        from mlaserve.bench.plot import draw, serving_panels

        draw(serving_panels(records), args.plot, f"bench serving: {records[0]['model']}, {args.backend} backend, "
             f"in {args.random_input_len} / out {args.random_output_len}")
        print(f"plot: {args.plot}")
    return 0 if completed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
