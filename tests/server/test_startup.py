"""Starting and stopping, as a user meets it: the HTTP process imports no model, kernel or Triton code; every
user error while starting prints ONE line (no traceback) and exits non-zero with no process and no ZeroMQ ipc
file left behind; a normal stop, a dead scheduler and the Engine API remove their ipc files too.

Each case runs `mlaserve` (or a script) in a subprocess whose TMPDIR is a fresh directory, so the ipc files
(`<TMPDIR>/mlaserve-<pid>-...`) of that run alone are checked.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

SERVER_MODULES = ["mlaserve.server.serve", "mlaserve.server.openai", "mlaserve.server.manager",
                  "mlaserve.server.engine", "mlaserve.server.launch", "mlaserve.server.metrics", "mlaserve.cli"]
FORBIDDEN = ["mlaserve.models", "mlaserve.kernels", "mlaserve.layers", "mlaserve.engine", "mlaserve.attention",
             "mlaserve.kvcache", "mlaserve.scheduler.scheduler", "triton", "torch"]
QUIET = ["--log-level", "warning"]


def test_http_process_imports_no_model_kernel_or_torch() -> None:
    code = (f"import sys; import {', '.join(SERVER_MODULES)}; "
            f"print([m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') or m in {FORBIDDEN!r}"
            f" or any(m.startswith(f + '.') for f in {FORBIDDEN!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# --- helpers ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(tmp: Path, cache: Path | None = None) -> dict:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    if cache is not None:
        env["MLASERVE_CACHE"] = str(cache)
    return env


def run_cli(args: list[str], tmp: Path, cache: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlaserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env_for(tmp, cache), stdin=subprocess.DEVNULL)


def ipc_files(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("mlaserve-*"))


def assert_one_line_error(proc: subprocess.CompletedProcess, tmp: Path, *words: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode not in (0, None), proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert ipc_files(tmp) == []


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "a child process outlived the server"


@pytest.fixture(scope="module")
def model(demo_cache: Path) -> str:
    from mlaserve.server.launch import demo_model_path

    return str(demo_model_path())


# --- user errors: one line, non-zero, nothing left ---------------------------------------------------------

def test_missing_model_path(tmp_path: Path) -> None:
    proc = run_cli(["serve", "--model-path", "/nonexistent", "--port", str(free_port())], tmp_path)
    assert_one_line_error(proc, tmp_path, "--model-path /nonexistent")


def test_model_path_with_a_bad_config(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    proc = run_cli(["serve", "--model-path", str(tmp_path / "m"), "--port", str(free_port())], tmp_path)
    assert_one_line_error(proc, tmp_path, "config.json")


def test_missing_chat_template(tmp_path: Path, model: str) -> None:
    proc = run_cli(["serve", "--model-path", model, "--chat-template", "missing.jinja", "--port",
                    str(free_port())], tmp_path)
    assert_one_line_error(proc, tmp_path, "--chat-template missing.jinja")


def test_port_in_use(tmp_path: Path, model: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli(["serve", "--model-path", model, "--port", str(port)], tmp_path)
    assert_one_line_error(proc, tmp_path, f"--port {port}")


@pytest.mark.parametrize("case", ["missing", "not-json", "unsupported"])
def test_make_checkpoint_bad_config(tmp_path: Path, case: str) -> None:
    cfg = tmp_path / "config.json"
    if case == "not-json":
        cfg.write_text("{")
    elif case == "unsupported":
        cfg.write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_attention_heads": 4,
                                   "hidden_act": "gelu"}))
    proc = run_cli(["make-checkpoint", "--config", str(cfg), "--out", str(tmp_path / "out")], tmp_path)
    assert_one_line_error(proc, tmp_path, str(cfg))
    assert not (tmp_path / "out").exists()


def test_scheduler_killed_during_startup(tmp_path: Path, model: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", "--model-path", model, "--port",
                             str(free_port()), *QUIET], env=env_for(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    sched = None
    deadline = time.monotonic() + 60
    while sched is None and time.monotonic() < deadline and proc.poll() is None:
        for pid in children(proc.pid):
            seen.add(pid)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                sched = pid
        time.sleep(0.02)
    assert sched is not None, "no scheduler process appeared"
    os.kill(sched, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, "", err), tmp_path,
                          "scheduler", "SIGKILL")
    wait_gone(list(seen))


def test_engine_without_main_guard(tmp_path: Path, model: str) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import mlaserve
        engine = mlaserve.Engine(model_path={model!r}, device="cpu", dtype="float32", max_total_tokens=1024,
                                 log_level="warning")
        print(engine.generate(prompt="hi", sampling_params={{"max_new_tokens": 2}})["text"])
        engine.shutdown()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=env_for(tmp_path), stdin=subprocess.DEVNULL)
    assert_one_line_error(proc, tmp_path, "__main__")


# --- normal exits remove their ipc files too -----------------------------------------------------------------

def start_and_wait(model: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", "--model-path", model, "--port",
                             str(port), "--max-total-tokens", "2048", "--context-length", "1024", *QUIET],
                            env=env_for(tmp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()
    assert len(ipc_files(tmp)) == 2           # the request and output sockets, while serving
    return proc, url


def test_sigterm_and_dead_scheduler_leave_no_ipc_files(tmp_path: Path, model: str) -> None:
    first, second = tmp_path / "sigterm", tmp_path / "dead"
    first.mkdir()
    second.mkdir()
    proc, _ = start_and_wait(model, first)
    kids = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert ipc_files(first) == []
    wait_gone(kids)
    proc, url = start_and_wait(model, second)
    sched = httpx.get(url + "/get_server_info", trust_env=False).json()["scheduler_pid"]
    os.kill(sched, signal.SIGKILL)
    assert proc.wait(60) != 0
    assert ipc_files(second) == []


def test_engine_shutdown_and_exit_without_shutdown_leave_no_ipc_files(tmp_path: Path, model: str) -> None:
    """And a --device cpu Engine's own process never imports torch (1.5 s of every start when it did)."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, mlaserve
        if __name__ == "__main__":
            kw = dict(model_path={model!r}, device="cpu", dtype="float32", max_total_tokens=1024, log_level="warning")
            engine = mlaserve.Engine(**kw)
            print(len([f for f in os.listdir(sys.argv[1]) if f.startswith("mlaserve-")]))
            print("torch" in sys.modules)           # the ranks import it, not the process that starts them
            engine.shutdown()
            print(len([f for f in os.listdir(sys.argv[1]) if f.startswith("mlaserve-")]))
            mlaserve.Engine(**kw)                   # never shut down: the interpreter's exit cleans up
    """))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=180, env=env_for(tmp_path), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "False", "0"]
    assert ipc_files(tmp_path) == []


def test_listening_socket_gives_connections_with_nagle_off() -> None:
    """asyncio sets TCP_NODELAY on accepted sockets only when their proto is IPPROTO_TCP; with Nagle on, a
    streamed first chunk waits ~40 ms for the client's delayed ACK on every kept-alive connection."""
    import asyncio

    from mlaserve.server.launch import listen

    sock = listen("127.0.0.1", free_port())
    seen: list[int] = []

    async def main() -> None:
        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen and seen[0] != 0, "accepted connections keep Nagle's algorithm on"
