"""Server life cycle: a client that disconnects frees its KV, SIGTERM leaves no process behind and exits 0, a dead
scheduler makes /health fail and the server exit non-zero; the generated `mlaserve serve` command line."""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import httpx
import pytest

from mlaserve.config import ServerConfig, add_config_args, config_from_args

USER = [{"role": "user", "content": "Tell me a very long story."}]
LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}


def wait_for(pred, timeout: float = 30.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met in {timeout} s")


def kv_held_by_requests(info: dict) -> int:
    # NOTE: the radix cache keeps finished (and aborted) requests' KV; what requests hold is the rest
    return info["used_tokens"] - info["cached_tokens_in_tree"]


def idle_and_freed(http: httpx.Client, baseline: int) -> dict | None:
    info = http.get("/get_server_info").json()
    ok = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and kv_held_by_requests(info) == baseline
    return info if ok else None


def test_disconnect_mid_stream_aborts_and_frees_kv(server, http):
    before = wait_for(lambda: idle_and_freed(http, 0))
    with httpx.stream("POST", server.url + "/v1/chat/completions", trust_env=False, timeout=60,
                      headers={"Authorization": f"Bearer {server.api_key}"},
                      json={"messages": USER, "stream": True, **LONG}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break    # one generated chunk arrived; leaving the block closes the connection mid-stream
        else:
            raise AssertionError("the stream ended before any content")
    after = wait_for(lambda: idle_and_freed(http, 0))
    assert after["generation_tokens"] - before["generation_tokens"] < 1000   # it stopped early


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server, http):
    before = wait_for(lambda: idle_and_freed(http, 0))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", **LONG}, timeout=0.5,
                   headers={"Authorization": f"Bearer {server.api_key}"}, trust_env=False)
    after = wait_for(lambda: idle_and_freed(http, 0))
    assert after["generation_tokens"] - before["generation_tokens"] < 1000


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_exits_0_with_no_orphan(start_server):
    srv = start_server("--max-total-tokens", "2048", "--context-length", "2048")
    sched = httpx.get(srv.url + "/get_server_info", trust_env=False).json()["scheduler_pid"]
    assert pid_alive(sched)

    def stream_forever() -> None:   # a request in flight while the server shuts down
        try:
            body = {"text": "go", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
            with httpx.stream("POST", srv.url + "/generate", trust_env=False, timeout=60, json=body) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream_forever, daemon=True)
    t.start()
    time.sleep(0.5)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    assert not pid_alive(sched), "the scheduler process outlived the server"
    t.join(10)
    time.sleep(1.0)                 # the multiprocessing resource tracker reports leaks as it exits, after the server
    assert "leaked semaphore" not in srv.log(), srv.log()[-600:]


def test_dead_scheduler_fails_health_and_exits_nonzero(start_server):
    srv = start_server("--max-total-tokens", "2048", "--context-length", "2048")
    sched = httpx.get(srv.url + "/get_server_info", trust_env=False).json()["scheduler_pid"]
    os.kill(sched, signal.SIGKILL)

    def health_503() -> bool:
        try:
            return httpx.get(srv.url + "/health", trust_env=False, timeout=2).status_code == 503
        except httpx.TransportError:
            return False

    wait_for(health_503, timeout=10, every=0.05)
    assert srv.proc.wait(30) != 0
    assert "scheduler process died" in srv.log()


# --- the command line -------------------------------------------------------------------------------------

def test_serve_flags_are_generated_from_the_config(capsys):
    from mlaserve.server.serve import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for section in ("model loading:", "parallelism:", "KV cache:", "scheduling:", "server:"):
        assert section in out
    for flag in ("--model-path", "--tp-size", "--max-total-tokens", "--tool-call-parser", "--enable-metrics",
                 "--watchdog-timeout", "--served-model-name", "--chunked-prefill-size"):
        assert flag in out
    cfg = parse_args(["--model-path", "/m", "--tp-size", "1", "--disable-radix-cache", "--cuda-graph-bs", "1", "4",
                      "--reasoning-parser", "deepseek-r1", "--port", "8000"])
    assert (cfg.load.model_path, cfg.parallel.tp_size, cfg.cache.disable_radix_cache) == ("/m", 1, True)
    assert (cfg.sched.cuda_graph_bs, cfg.reasoning_parser, cfg.port, cfg.host) == ([1, 4], "deepseek-r1", 8000,
                                                                                   "127.0.0.1")
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    assert config_from_args(parser.parse_args([])) == ServerConfig()   # no flags: the dataclass defaults
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])


@pytest.mark.parametrize("flags,words", [
    (["--tp-size", "3"], "--tp-size 3: model.layers.0.self_attn.q_proj.weight has 16 heads"),
    (["--tp-size", "2", "--nnodes", "2"], "--nnodes 2: give --dist-init-addr"),
    (["--tp-size", "2", "--device", "cuda:1"], "--device cuda:1 with --tp-size 2"),
    (["--dp-size", "2", "--enable-dp-attention"], "--dp-size 2"),
    (["--device", "cpu", "--enable-torch-compile"], "--enable-torch-compile"),
])
def test_unsupported_flags_exit_in_one_line_before_any_process_starts(tmp_path, flags, words):
    """Rejected in the main process from config.json alone (no weights, no tokenizer, no scheduler spawned)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import mlaserve

    src = Path(mlaserve.__file__).parent / "tools" / "configs" / "deepseek-v2-lite.json"
    (tmp_path / "config.json").write_text(json.dumps(json.loads(src.read_text())))
    out = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", "--model-path", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert out.returncode != 0 and len(lines) == 1 and words in lines[0], lines


def test_watchdog_exits_a_stuck_step_and_says_where_it_was():
    """A step past --watchdog-timeout ends the rank's process with code 3, a one-line error, and every thread's
    stack (where the step waits: a collective, a kernel's sync)."""
    import subprocess
    import sys

    code = ("import logging, time\n"
            "from mlaserve.scheduler.process import Watchdog\n"
            "logging.basicConfig()\n"
            "def a_step_that_never_ends():\n"
            "    w = Watchdog(0.5); w.beat(); time.sleep(60)\n"
            "a_step_that_never_ends()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out
    assert "watchdog: a scheduler step has run for over" in out.stderr, out.stderr
    assert "a_step_that_never_ends" in out.stderr, out.stderr
