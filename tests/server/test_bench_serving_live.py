"""`mlaserve bench serving` against the live demo server: every backend completes every request and the
--output-file JSON has every metric."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlaserve.bench import serving

NUM_PROMPTS, OUTPUT_LEN = 4, 6
STAT_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2e_latency") for s in ("mean", "median", "std", "p99")]
METRIC_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "input_throughput", "output_throughput", "total_throughput", "concurrency", "errors", *STAT_KEYS]


@pytest.mark.parametrize("backend", ["openai-chat", "openai", "mlaserve"])
def test_bench_serving_against_the_demo_server(server, tmp_path: Path, backend: str, capsys):
    out = tmp_path / "bench.jsonl"
    rc = serving.main(["--base-url", server.url, "--backend", backend, "--api-key", server.api_key,
                       "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "24",
                       "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1",
                       "--request-rate", "inf", "--warmup-requests", "1", "--disable-tqdm",
                       "--tokenizer", str(server.model_path), "--output-file", str(out)])
    assert rc == 0
    (line,) = out.read_text().splitlines()
    rec = json.loads(line)
    missing = [k for k in METRIC_KEYS if k not in rec]
    assert not missing, f"missing metrics: {missing}"
    assert (rec["completed"], rec["failed"], rec["errors"]) == (NUM_PROMPTS, 0, [])
    assert rec["model"] == "mlaserve-demo"
    assert rec["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN      # ignore_eos: exact lengths
    assert rec["total_input_tokens"] >= NUM_PROMPTS * 24               # the chat template / BOS add a few
    for k in STAT_KEYS:
        assert rec[k] is not None and rec[k] >= 0, k
    assert 0 < rec["mean_ttft_ms"] <= rec["mean_e2e_latency_ms"]
    assert "serving benchmark" in capsys.readouterr().out


def test_speculative_server_serves_the_openai_client_and_reports_accept_length(start_server, tmp_path: Path):
    """A server decoding speculatively (the demo model's MTP head): the official client gets its completion,
    `meta_info` carries the verify count, and `bench serving` prints the run's accept length."""
    import httpx
    import openai

    srv = start_server("--speculative-algorithm", "EAGLE", "--max-total-tokens", "4096", "--log-level", "error")
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        done = client.completions.create(model="mlaserve-demo", prompt="def fibonacci(n):\n", max_tokens=24,
                                         temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens == 24
    meta = httpx.post(srv.url + "/generate", json={"text": "class Stack:\n", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0}}, timeout=120, trust_env=False).json()["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1
    out = tmp_path / "bench.jsonl"
    rc = serving.main(["--base-url", srv.url, "--backend", "mlaserve", "--num-prompts", "4",
                       "--random-input-len", "24", "--random-output-len", "16", "--random-range-ratio", "1",
                       "--request-rate", "inf", "--warmup-requests", "1", "--disable-tqdm",
                       "--tokenizer", str(srv.model_path), "--output-file", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text().splitlines()[0])
    assert rec["completed"] == 4 and rec["accept_length"] is not None and rec["accept_length"] >= 1.0
