"""`mlaserve bench serving` against a mock OpenAI-compatible server that streams one token every TOKEN_DELAY."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mlaserve.bench import serving

FIRST_DELAY = 0.06  # s from request to the first token
TOKEN_DELAY = 0.02  # s between tokens
CHAT_OVERHEAD = 3  # prompt tokens the mock's "chat template" adds: usage must override what the client sent
STAT_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2e_latency") for s in ("mean", "median", "std", "p99")]
METRIC_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "input_throughput", "output_throughput", "total_throughput", "concurrency", *STAT_KEYS]


class Mock:
    """Records every request body and arrival time; `fail(i)` picks the i-th request's failure (None, 500, sse)."""

    def __init__(self, usage: bool = True, fail: Callable[[int], Any] = lambda i: None, burst: int = 1) -> None:
        self.usage, self.fail, self.burst = usage, fail, burst     # burst: tokens per content chunk
        self.bodies: list[dict[str, Any]] = []
        self.arrivals: list[float] = []

    async def handle(self, request: Request, kind: str) -> Any:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append(time.perf_counter())
        failure = self.fail(len(self.bodies) - 1)
        if failure == 500:
            return JSONResponse({"error": {"message": "mock overload"}}, status_code=500)
        gen = self.broken() if failure == "sse" else self.stream(body, kind)
        return StreamingResponse(gen, media_type="text/event-stream")

    async def broken(self) -> AsyncIterator[str]:
        yield "data: {this is not json\n\n"

    async def stream(self, body: dict[str, Any], kind: str) -> AsyncIterator[str]:
        n_out = body["sampling_params"]["max_new_tokens"] if kind == "native" else body["max_tokens"]
        prompt = body.get("prompt") or body.get("text") or body["messages"][0]["content"]
        n_in = len(prompt.split()) + (CHAT_OVERHEAD if kind == "chat" else 0)
        yield sse(chunk(kind, "", 0, n_in, role=True))  # an empty first chunk must not count as the first token
        await asyncio.sleep(FIRST_DELAY)
        # tokens arrive every TOKEN_DELAY; they are sent in chunks of `burst` (as a slow reader or a server
        # producing several tokens a step sees them), the first chunk as soon as its first token is out
        sent = 0
        for i in range(n_out):
            if i:
                await asyncio.sleep(TOKEN_DELAY)
            if i == 0 or i + 1 - sent == self.burst or i == n_out - 1:
                yield sse(chunk(kind, "".join(f" t{j}" for j in range(sent, i + 1)), i + 1, n_in))
                sent = i + 1
        if kind != "native" and self.usage:
            yield sse({"choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out}})
        yield "data: [DONE]\n\n"


def chunk(kind: str, text: str, i: int, n_in: int, role: bool = False) -> dict[str, Any]:
    if kind == "native":  # cumulative text, counts in meta_info
        meta = {"prompt_tokens": n_in, "completion_tokens": i}
        return {"text": "".join(f" t{j}" for j in range(i)), "meta_info": meta}
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        return {"choices": [{"index": 0, "delta": delta}], "usage": None}
    return {"choices": [{"index": 0, "text": text}], "usage": None}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(mock: Mock) -> FastAPI:
    app = FastAPI()
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "mock-model", "object": "model"}]})
    for path, kind in (("/v1/completions", "text"), ("/v1/chat/completions", "chat"), ("/generate", "native")):
        app.post(path)(endpoint(mock, kind))
    return app


def endpoint(mock: Mock, kind: str) -> Any:
    async def handle(request: Request) -> Any:
        return await mock.handle(request, kind)

    return handle


@contextlib.contextmanager
def serve(mock: Mock) -> Iterator[int]:
    """Run the mock on a free loopback port in a thread; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(mock), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


def run_main(port: int, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    argv = ["--port", str(port), "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "6",
            "--random-range-ratio", "0.5", "--seed", str(random.randrange(1 << 30)), "--disable-tqdm",
            "--output-file", str(out), *extra]
    rc = serving.main(argv)
    return rc, json.loads(out.read_text().splitlines()[-1])


def check_timing(rec: dict[str, Any]) -> None:
    assert all(rec[k] is not None for k in METRIC_KEYS), [k for k in METRIC_KEYS if rec[k] is None]
    assert rec["median_ttft_ms"] >= FIRST_DELAY * 1000  # every request waits for the mock's first token
    assert 0.5 * TOKEN_DELAY * 1000 <= rec["mean_tpot_ms"] <= 2.5 * TOKEN_DELAY * 1000
    assert 0.5 * TOKEN_DELAY * 1000 <= rec["median_itl_ms"] <= 2.5 * TOKEN_DELAY * 1000
    assert rec["mean_e2e_latency_ms"] >= FIRST_DELAY * 1000 + 2 * TOKEN_DELAY * 1000  # >= 3 tokens each
    assert rec["total_throughput"] >= rec["output_throughput"] > 0


def test_chat_all_at_once_respects_max_concurrency(tmp_path: Path) -> None:
    mock = Mock()
    with serve(mock) as port:
        rc, rec = run_main(port, tmp_path / "out.jsonl", "--backend", "openai-chat", "--max-concurrency", "2",
                           "--warmup-requests", "1")
    assert rc == 0 and rec["completed"] == 8 and rec["failed"] == 0 and rec["errors"] == []
    check_timing(rec)
    assert rec["concurrency"] <= 2.01  # sum of e2e / duration can not exceed the semaphore
    sent = mock.bodies[1:]  # the first body is the warm-up request
    assert len(sent) == 8 and rec["model"] == "mock-model" and rec["request_rate"] == "inf"
    for body in sent:
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0 and body["model"] == "mock-model"
        assert 3 <= body["max_tokens"] <= 6 and 8 <= len(body["messages"][0]["content"].split()) <= 16
    assert rec["total_output_tokens"] == sum(b["max_tokens"] for b in sent)
    words = sum(len(b["messages"][0]["content"].split()) for b in sent)
    assert rec["total_input_tokens"] == words + 8 * CHAT_OVERHEAD  # usage.prompt_tokens wins over the estimate


def test_completions_poisson_rate_counts_chunks_without_usage(tmp_path: Path) -> None:
    mock = Mock(usage=False)
    with serve(mock) as port:
        rc, rec = run_main(port, tmp_path / "out.jsonl", "--backend", "openai", "--request-rate", "16",
                           "--warmup-requests", "0")
    assert rc == 0 and rec["completed"] == 8 and rec["request_rate"] == 16
    check_timing(rec)
    # output tokens come from counting content chunks here; input tokens from the words we sent
    assert rec["total_output_tokens"] == sum(b["max_tokens"] for b in mock.bodies)
    assert rec["total_input_tokens"] == sum(len(b["prompt"].split()) for b in mock.bodies)
    # 7 exponential gaps of mean 1/16 s: a spread under 50 ms has probability ~2e-6
    assert mock.arrivals[-1] - mock.arrivals[0] > 0.05


def test_native_generate_per_request(tmp_path: Path) -> None:
    mock = Mock()
    args = serving.parse_args(["--backend", "mlaserve", "--num-prompts", "8", "--random-input-len", "12",
                               "--random-output-len", "5", "--warmup-requests", "0", "--disable-tqdm"])
    reqs = serving.random_requests(args, None)
    with serve(mock) as port:
        args.base_url = f"http://127.0.0.1:{port}"
        results, duration, _, _ = asyncio.run(serving.run_load(args, reqs))
    for req, res in zip(reqs, results):
        assert res.success, res.error
        assert res.output_tokens == req.output_len and len(res.itl) == req.output_len - 1
        # the last token cannot come before the mock has slept for all of them (a busy client may read the first
        # late and the rest at once, so no bound from ttft)
        assert res.ttft >= FIRST_DELAY and res.latency >= FIRST_DELAY + (req.output_len - 1) * TOKEN_DELAY * 0.9
        assert res.prompt_len == len(req.prompt.split()) == req.prompt_len
    m = serving.summarize(results, duration)
    assert m["concurrency"] > 3  # rate inf, no limit: the 8 requests overlap


def test_http_errors_and_malformed_sse_count_as_failed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mock = Mock(fail=lambda i: {1: 500, 3: "sse"}.get(i % 4))
    with serve(mock) as port:
        rc, rec = run_main(port, tmp_path / "out.jsonl", "--warmup-requests", "0", "--model", "m")
    assert rc == 0 and rec["completed"] == 4 and rec["failed"] == 4
    assert rec["total_output_tokens"] == sum(b["max_tokens"] for i, b in enumerate(mock.bodies) if i % 2 == 0)
    errors = " ".join(rec["errors"])
    assert "HTTP 500" in errors and "mock overload" in errors and "malformed SSE" in errors
    assert "HTTP 500" in capsys.readouterr().out


def test_closed_port_fails_every_request(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    rc, rec = run_main(port, tmp_path / "out.jsonl")
    assert rc == 1 and rec["completed"] == 0 and rec["failed"] == 8 and rec["model"] is None
    assert rec["mean_ttft_ms"] is None and "ConnectError" in rec["errors"][0]
    rc, _ = run_main(port, tmp_path / "out.jsonl")
    assert rc == 1 and len((tmp_path / "out.jsonl").read_text().splitlines()) == 2  # appended, one line per run


def tiny_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(serving.WORDS)] * 20 + ["Serving the models, fast! 42 + 7 = 49."], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))


def test_tokenizer_prompts_have_exact_lengths(tmp_path: Path) -> None:
    from mlaserve.tokenizer import load_tokenizer

    tiny_tokenizer(tmp_path)
    # SGLang-style abbreviated flags (--random-input) must parse; ratio 1 makes every length exact
    args = serving.parse_args(["--tokenizer", str(tmp_path), "--num-prompts", "16", "--random-input", "40",
                               "--random-output", "9", "--random-range-ratio", "1",
                               "--seed", str(random.randrange(1 << 30))])
    tok = load_tokenizer(tmp_path)
    reqs = serving.random_requests(args, tok)
    assert len({r.prompt for r in reqs}) == 16
    for req in reqs:
        ids = tok.encode(req.prompt, add_bos=False)
        assert len(ids) == req.prompt_len == 40 and req.output_len == 9
        assert tok.bos_token_id not in ids and tok.eos_token_id not in ids


def test_url_flags() -> None:
    assert serving.parse_args(["--host", "10.0.0.2", "--port", "8000"]).base_url == "http://10.0.0.2:8000"
    assert serving.parse_args(["--base-url", "http://h:1/"]).base_url == "http://h:1"
    for given in (["--port", "2"], ["--host", "h2"]):           # would be ignored: --base-url names the server
        with pytest.raises(SystemExit):
            serving.parse_args(["--base-url", "http://h:1/", *given])
    with pytest.raises(SystemExit):
        serving.parse_args(["--request-rate", "0"])


def test_the_seeds_bench_serving_line_runs_as_written() -> None:
    """SGLang's `bench_serving --backend sglang --random-input 256 --random-output 32 ...`: the native /generate
    protocol under SGLang's name, the length flags by their prefixes."""
    args = serving.parse_args("--backend sglang --dataset-name random --random-input 256 --random-output 32 "
                              "--random-range-ratio 1 --num-prompts 1 --host 127.0.0.1 --port 30000".split())
    assert (args.backend, args.random_input_len, args.random_output_len) == ("mlaserve", 256, 32)
    assert args.base_url + serving.ENDPOINTS[args.backend] == "http://127.0.0.1:30000/generate"


# --- ITL per generated token, several concurrency levels, the plot -----------------------------------------------

def test_native_stream_counts_tokens_per_chunk() -> None:
    state = serving.StreamState()
    assert state.feed("mlaserve", {"text": "", "meta_info": {"completion_tokens": 0}}) == 0
    assert state.feed("mlaserve", {"text": " a", "meta_info": {"completion_tokens": 1}}) == 1
    # three tokens in one chunk; then a token whose text is held back (an unfinished character or stop string)
    assert state.feed("mlaserve", {"text": " a b c d", "meta_info": {"completion_tokens": 4}}) == 3
    assert state.feed("mlaserve", {"text": " a b c d", "meta_info": {"completion_tokens": 5}}) == 1
    assert state.feed("mlaserve", {"text": " a b c d e"}) == 1           # a server without counts: one per chunk
    assert state.feed("openai", {"choices": [{"text": " x y"}]}) == 1     # OpenAI chunks carry no count


@pytest.mark.parametrize("burst", [1, 4])
def test_itl_is_per_generated_token_on_the_native_backend(tmp_path: Path, burst: int) -> None:
    """Tokens every TOKEN_DELAY, sent `burst` to a chunk: the native backend's ITL is TOKEN_DELAY per token whatever
    the chunking (one sample per token after the first chunk's); the OpenAI backend's is per chunk."""
    mock = Mock(burst=burst)
    with serve(mock) as port:
        rc, rec = run_main(port, tmp_path / "native.jsonl", "--backend", "mlaserve", "--warmup-requests", "0",
                           "--random-output-len", "13", "--random-range-ratio", "1")
        rc2, chunked = run_main(port, tmp_path / "openai.jsonl", "--backend", "openai", "--warmup-requests", "0",
                                "--random-output-len", "13", "--random-range-ratio", "1")
    assert rc == rc2 == 0 and rec["completed"] == chunked["completed"] == 8
    assert rec["total_output_tokens"] == chunked["total_output_tokens"] == 8 * 13
    assert (rec["itl_unit"], chunked["itl_unit"]) == ("token", "chunk")
    token_ms = TOKEN_DELAY * 1000
    assert 0.8 * token_ms <= rec["median_itl_ms"] <= 1.6 * token_ms, rec["median_itl_ms"]
    assert 0.8 * token_ms <= rec["mean_tpot_ms"] <= 1.6 * token_ms
    # per chunk, a burst's gap is `burst` tokens long
    assert 0.8 * burst * token_ms <= chunked["median_itl_ms"] <= 1.6 * burst * token_ms, chunked["median_itl_ms"]


def test_native_results_hold_one_gap_per_token() -> None:
    mock = Mock(burst=3)
    args = serving.parse_args(["--backend", "mlaserve", "--num-prompts", "4", "--random-input-len", "8",
                               "--random-output-len", "10", "--random-range-ratio", "1", "--warmup-requests", "0",
                               "--disable-tqdm"])
    with serve(mock) as port:
        args.base_url = f"http://127.0.0.1:{port}"
        results, _, _, _ = asyncio.run(serving.run_load(args, serving.random_requests(args, None)))
    for res in results:
        # chunks of tokens 1 | 2-4 | 5-7 | 8-10: every token after the first has its gap, a third of its chunk's
        assert res.success and res.output_tokens == 10 and len(res.itl) == 9
        assert all(res.itl[i] == res.itl[i + 1] == res.itl[i + 2] for i in (0, 3, 6))
        assert sum(res.itl) == pytest.approx(res.latency - res.ttft, abs=0.02)


def test_several_concurrency_levels_run_in_turn_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    mock = Mock()
    png = tmp_path / "serving.png"
    with serve(mock) as port:
        argv = ["--port", str(port), "--backend", "mlaserve", "--num-prompts", "6", "--random-input-len", "8",
                "--random-output-len", "4", "--warmup-requests", "0", "--disable-tqdm", "--max-concurrency", "1", "3",
                "--output-file", str(tmp_path / "out.jsonl"), "--plot", str(png)]
        assert serving.main(argv) == 0
    recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["max_concurrency"] for r in recs] == [1, 3] and all(r["completed"] == 6 for r in recs)
    assert recs[0]["concurrency"] <= 1.01 < recs[1]["concurrency"] <= 3.01
    assert recs[0]["seed"] != recs[1]["seed"]          # other prompts: no prefix-cache hits across levels
    assert len(mock.bodies) == 12
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 300 and img.shape[1] > 3 * img.shape[0] // 2    # three panels side by side


def test_plot_without_matplotlib_fails_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)          # makes `import matplotlib` raise ImportError
    assert serving.main(["--port", "9", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --plot needs matplotlib, which is not installed: pip install 'mlaserve[plot]' " \
                  "(or: pip install matplotlib)"


def test_several_client_processes_split_the_load_and_keep_request_order(tmp_path: Path) -> None:
    """--client-processes 3: every request sent once, at most the concurrency in flight over all processes, each
    result beside its own request."""
    mock = Mock()
    args = serving.parse_args(["--backend", "mlaserve", "--num-prompts", "10", "--random-input-len", "12",
                               "--random-range-ratio", "0.3", "--random-output-len", "5", "--warmup-requests", "1",
                               "--max-concurrency", "4", "--client-processes", "3", "--disable-tqdm"])
    args = serving.levels(args)[0]
    reqs = serving.random_requests(args, None)
    assert serving.client_processes(args) == 3 and serving._shares(4, 3) == [2, 1, 1]
    with serve(mock) as port:
        args.base_url = f"http://127.0.0.1:{port}"
        results, duration, model, _ = asyncio.run(serving.run_load(args, reqs))
    assert model == "mock-model" and len(mock.bodies) == 1 + 10
    assert sorted(b["text"] for b in mock.bodies[1:]) == sorted(r.prompt for r in reqs)
    for req, res in zip(reqs, results):
        assert res.success, res.error
        assert res.prompt_len == len(req.prompt.split()) and res.output_tokens == req.output_len
    m = serving.summarize(results, duration)
    assert m["completed"] == 10 and m["concurrency"] <= 4.01
    assert duration >= FIRST_DELAY + 4 * TOKEN_DELAY      # from the common start to the last process's end


def test_client_processes_by_default_follow_the_concurrency(monkeypatch) -> None:
    monkeypatch.setattr(serving.os, "cpu_count", lambda: 32)
    for conc, want in ((None, 1), (16, 1), (128, 1), (129, 2), (512, 4), (4096, 8)):
        args = serving.parse_args(["--disable-tqdm"] + (["--max-concurrency", str(conc)] if conc else []))
        assert serving.client_processes(levels_one(args)) == want, conc
    monkeypatch.setattr(serving.os, "cpu_count", lambda: 2)
    assert serving.client_processes(levels_one(serving.parse_args(["--max-concurrency", "1024"]))) == 1


def levels_one(args):
    return serving.levels(args)[0]
