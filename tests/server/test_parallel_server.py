"""Tensor parallelism through `mlaserve serve` on the CPU (gloo): the openai client against --tp-size 2 (with and
without --ep-size 2) and against data-parallel attention (--tp-size 2 --dp-size 2, with and without --ep-size 2),
two "nodes" on loopback (tensor parallel, and DP attention with a group on each node; on a two-GPU host, two nodes
of one GPU each), a rank killed while serving, and a busy --dist-init-addr."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

import mlaserve
from conftest import free_port

MODEL = "tp-test"
CPU_ARGS = ["--device", "cpu", "--max-total-tokens", "4096", "--log-level", "warning"]   # two gloo ranks, any machine


@pytest.fixture(scope="module")
def reference(demo_cache):
    """Greedy completions of the demo model from the single-process Engine."""
    from mlaserve.server.launch import demo_model_path

    with mlaserve.Engine(device="cpu", log_level="warning") as engine:
        outs = engine.generate(prompt=PROMPTS, sampling_params={"max_new_tokens": 12, "temperature": 0})
    return str(demo_model_path()), [o["text"] for o in outs]


PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Tensor parallelism splits"]


def complete(url: str, prompt: str) -> str:
    client = OpenAI(base_url=url + "/v1", api_key="none")
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text


@pytest.mark.parametrize("ep", [1, 2])       # --ep-size 2: each rank holds 8 of the demo model's 16 routed experts
def test_tp2_server_serves_the_openai_client_like_one_process(start_server, reference, ep):
    _, expected = reference
    srv = start_server("--tp-size", "2", "--ep-size", str(ep), "--served-model-name", MODEL, *CPU_ARGS)
    assert [complete(srv.url, p) for p in PROMPTS] == expected
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    import httpx

    info = httpx.get(srv.url + "/get_server_info").json()
    assert (info["tp_size"], info["ep_size"]) == (2, ep) and len(info["rank_pids"]) == 2
    bad = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"})
    assert bad.status_code == 400 and complete(srv.url, PROMPTS[0]) == expected[0]   # still serving after a 400


@pytest.mark.parametrize("ep", [1, 2])       # --ep-size 2: the MoE's experts split whole over both ranks
def test_dp_attention_server_serves_the_openai_client_like_one_process(start_server, reference, ep):
    """Two DP-attention groups (one rank each, the MoE over both): requests spread over both groups give the single
    process's completions; a stream closed early is aborted on its group; stats and metrics per group; a killed
    rank ends the server in one line."""
    import httpx

    _, expected = reference
    srv = start_server("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", str(ep),
                       "--load-balance-method",
                       "round_robin", "--enable-metrics", "--dist-timeout", "20", "--served-model-name", MODEL, *CPU_ARGS)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:                 # together: both groups busy, or one idle
        assert list(pool.map(lambda p: complete(srv.url, p), PROMPTS)) == expected
    assert [complete(srv.url, p) for p in PROMPTS] == expected     # one at a time: the other group idles
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()                                                 # the client goes away: abort on its group
    deadline = time.monotonic() + 30
    while (info := httpx.get(srv.url + "/get_server_info").json())["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert info["num_running_reqs"] == 0 and info["generation_tokens"] < 2 * 3 * 12 + 900, info
    assert (info["dp_size"], info["ep_size"]) == (2, ep) and len(info["rank_pids"]) == 2
    groups = info["dp_groups"]
    assert [g["dp_rank"] for g in groups] == [0, 1] and all(g["prompt_tokens"] > 0 for g in groups), groups
    assert info["max_total_tokens"] == sum(g["max_total_tokens"] for g in groups)   # one KV pool per group
    metrics = httpx.get(srv.url + "/metrics").text
    for rank in (0, 1):
        assert f'mlaserve:prompt_tokens_total{{dp_rank="{rank}"}}' in metrics, metrics
    assert complete(srv.url, PROMPTS[1]) == expected[1]
    os.kill(info["rank_pids"][1], signal.SIGKILL)                 # group 1's only rank, while both groups idle
    assert srv.proc.wait(timeout=30) != 0
    assert "rank 1's scheduler process died (killed by SIGKILL)" in srv.log(), srv.log()[-2000:]


def test_killing_a_rank_ends_the_server_in_one_line(start_server):
    srv = start_server("--tp-size", "2", "--dist-timeout", "20", *CPU_ARGS)
    import httpx

    pids = httpx.get(srv.url + "/get_server_info").json()["rank_pids"]
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    code = srv.proc.wait(timeout=30)
    assert code != 0 and time.monotonic() - t0 < 20 + 10
    assert "rank 1's scheduler process died (killed by SIGKILL)" in srv.log(), srv.log()[-2000:]
    time.sleep(1)
    assert not [p for p in pids if _running(p)], "a rank process was left running"


def _free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free (the store, then DP attention's ZeroMQ ports after it)."""
    for _ in range(50):
        p = free_port()
        try:
            socks = []
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


# layout -> the flags of both "nodes" (one rank each): tensor parallel, and DP attention with a group on each node
# (group 1's leader on node 1 reads its requests from node 0's manager over TCP, the ports after --dist-init-addr's)
NODE_LAYOUTS = {"tp2": ["--tp-size", "2"],
                "tp2-dp2": ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--load-balance-method",
                            "round_robin"]}


@pytest.mark.parametrize("layout", list(NODE_LAYOUTS))
def test_two_nodes_on_loopback_equal_one_process(start_server, demo_cache, reference, tmp_path, layout):
    """Node 1 (`serve --node-rank 1`: ranks only) and node 0 (HTTP + rank 0) meet at --dist-init-addr and serve
    the single process's completions, requests one at a time and together."""
    import httpx

    path, expected = reference
    common = ["--model-path", path, *NODE_LAYOUTS[layout], "--nnodes", "2", "--dist-init-addr",
              f"127.0.0.1:{_free_ports(4)}", *CPU_ARGS]
    env = {**os.environ, "MLASERVE_CACHE": str(demo_cache)}
    node1_log = tmp_path / "node1.log"
    with open(node1_log, "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", *common, "--node-rank", "1"],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
    node0 = start_server(*common, "--node-rank", "0", "--served-model-name", MODEL, wait=False)
    try:
        node0.wait_healthy()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda p: complete(node0.url, p), PROMPTS)) == expected
        assert [complete(node0.url, p) for p in PROMPTS] == expected
        if layout == "tp2-dp2":
            groups = httpx.get(node0.url + "/get_server_info").json()["dp_groups"]
            assert [g["dp_rank"] for g in groups] == [0, 1] and all(g["prompt_tokens"] > 0 for g in groups), groups
    finally:
        node0.stop()
    # node 0 went away: node 1's rank loses its collectives and the node exits with one line
    assert node1.wait(timeout=60) != 0
    lines = [ln for ln in node1_log.read_text().splitlines() if "ERROR" in ln or "error" in ln.lower()]
    assert any("rank 1" in ln for ln in lines), node1_log.read_text()[-2000:]


@pytest.mark.multi_gpu
def test_two_gpus_as_two_nodes_equal_one_gpu(start_server, demo_cache, tmp_path, monkeypatch):
    """One host's two GPUs as two nodes of one GPU each (each node's process sees only its own GPU; the ranks meet
    over NCCL, the peer buffers refused as the group spans nodes), fp32: the one-GPU Engine's greedy completions."""
    from mlaserve.server.launch import demo_model_path

    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        monkeypatch.setenv(var, value)                             # never NVLink multicast (inherited by the nodes)
    with mlaserve.Engine(dtype="float32", log_level="warning") as engine:
        outs = engine.generate(prompt=PROMPTS, sampling_params={"max_new_tokens": 12, "temperature": 0})
    expected = [o["text"] for o in outs]
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[:2]   # the first two this process may use
    common = ["--model-path", str(demo_model_path()), "--tp-size", "2", "--nnodes", "2", "--dist-init-addr",
              f"127.0.0.1:{_free_ports(4)}", "--dtype", "float32", "--log-level", "warning"]
    node1_log = tmp_path / "node1.log"
    with open(node1_log, "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", *common, "--node-rank", "1"],
                                 stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "MLASERVE_CACHE": str(demo_cache), "CUDA_VISIBLE_DEVICES": gpus[1]})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus[0])           # node 0 (start_server inherits this process's env)
    node0 = start_server(*common, "--node-rank", "0", "--served-model-name", MODEL, wait=False)
    try:
        node0.wait_healthy()
        assert [complete(node0.url, p) for p in PROMPTS] == expected
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda p: complete(node0.url, p), PROMPTS)) == expected
    finally:
        node0.stop()
        try:
            node1.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node1.kill()
            raise AssertionError(f"node 1 outlived node 0:\n{node1_log.read_text()[-2000:]}") from None


def test_busy_dp_attention_port_is_one_line(demo_cache):
    """Node 0 checks the ZeroMQ ports after --dist-init-addr's before starting any rank."""
    port = _free_ports(4)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 2))
        busy.listen(1)
        out = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", "--tp-size", "2", "--dp-size", "2",
                              "--enable-dp-attention", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr",
                              f"127.0.0.1:{port}", "--port", str(free_port()), *CPU_ARGS], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "MLASERVE_CACHE": str(demo_cache)})
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert out.returncode != 0 and len(lines) == 1 and f"port {port + 2}" in lines[0], lines


def test_busy_dist_init_addr_is_one_line(demo_cache, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", "--tp-size", "2", "--port",
                              str(free_port()), "--dist-init-addr", f"127.0.0.1:{port}", "--dist-timeout", "20",
                              *CPU_ARGS], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "MLASERVE_CACHE": str(demo_cache)})
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip() and "loading weights" not in ln]
    assert out.returncode != 0 and any(f"--dist-init-addr 127.0.0.1:{port}" in ln for ln in lines), lines
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.gpu
def test_more_ranks_than_gpus_is_one_line(tmp_path):
    import torch

    src = Path(mlaserve.__file__).parent / "tools" / "configs" / "deepseek-v2-lite.json"
    (tmp_path / "config.json").write_text(src.read_text())
    tp = 2 * torch.cuda.device_count()
    out = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", "--model-path", str(tmp_path), "--tp-size",
                          str(tp)], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert out.returncode != 0 and len(lines) == 1 and "are visible" in lines[0], lines


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
