"""Server test fixtures: a session MLASERVE_CACHE (tmp dir) beside the shipped demo model, one real
`mlaserve serve` subprocess on a loopback port shared by the session, and a scripted stand-in for the tokenizer
manager (fixed model text, for the tool-call / reasoning paths that random weights cannot exercise)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from mlaserve.server.launch import free_port as launch_free_port

API_KEY = "test-key"
START_TIMEOUT_S = 120.0
CONTEXT_LEN = 1024
FUZZ_CONTEXT_LEN = 16
# NOTE: float32 on every device: the batch-invariance tests compare greedy tokens exactly, and a random-weight
# model's bf16 logits tie (or flip an expert choice) between batch shapes on a GPU
SHARED_ARGS = ["--max-total-tokens", "4096", "--context-length", str(CONTEXT_LEN), "--api-key", API_KEY,
               "--enable-metrics", "--log-level", "warning", "--dtype", "float32"]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port not handed out before in this session: a test taking two (an HTTP port and a
    --dist-init-addr port) must not get the same one twice, which the kernel can return for back-to-back asks."""
    while (port := launch_free_port()) in _HANDED_OUT:
        pass
    _HANDED_OUT.add(port)
    return port


class ServerProcess:
    """`python -m mlaserve.cli serve --port P ARGS...` with its log in a file."""

    def __init__(self, args: list[str], log_path: Path, cache: Path):
        self.port = free_port()
        self.api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.context_len = int(args[args.index("--context-length") + 1]) if "--context-length" in args else None
        self.model_path = Path(args[args.index("--model-path") + 1]) if "--model-path" in args else None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # NOTE: one torch thread: several servers, the scheduler processes and pytest share 2 cores, and
        # spinning intra-op threads there slow a decode step of the demo model ~8x
        env = {**os.environ, "MLASERVE_CACHE": str(cache), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self.log_file, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server was not healthy after {timeout:.0f} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_file.close()


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MLASERVE_CACHE for the session (the demo model itself is package data; derived copies go here)."""
    cache = tmp_path_factory.mktemp("mlaserve-cache")
    old = os.environ.get("MLASERVE_CACHE")
    os.environ["MLASERVE_CACHE"] = str(cache)
    from mlaserve.server.launch import demo_model_path

    demo_model_path()
    yield cache
    if old is None:
        os.environ.pop("MLASERVE_CACHE", None)
    else:
        os.environ["MLASERVE_CACHE"] = old


@pytest.fixture(scope="session")
def start_server(demo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Factory: start a server with extra args (stopped at the end of the session at the latest)."""
    from mlaserve.server.launch import demo_model_path

    started: list[ServerProcess] = []

    def start(*args: str, wait: bool = True) -> ServerProcess:
        log = tmp_path_factory.mktemp("server-log") / "server.log"
        server = ServerProcess(list(args), log, demo_cache)
        server.model_path = server.model_path or demo_model_path()
        started.append(server)
        if wait:
            server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """The session's shared server on the demo model (API key API_KEY, metrics on, context CONTEXT_LEN)."""
    return start_server(*SHARED_ARGS)


@pytest.fixture(scope="session")
def fuzz_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A server for fuzzing: no API key, context FUZZ_CONTEXT_LEN so a valid fuzzed request stays short."""
    return start_server("--context-length", str(FUZZ_CONTEXT_LEN), "--max-total-tokens", "4096", "--log-level",
                        "error")


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                      trust_env=False) as client:
        yield client


@pytest.fixture
def oai(server: ServerProcess):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


# --- a scripted stand-in for TokenizerManager ---------------------------------------------------------------

class ScriptedManager:
    """Answers every request with `script(request_index, GenerateInput) -> str`, streamed in `pieces` pieces
    (cumulative snapshots, as the real manager yields), finishing with "stop". Records every request and
    every request closed before it finished (what the real manager aborts)."""

    def __init__(self, tokenizer, script: Callable, pieces: int = 7, context_len: int = CONTEXT_LEN):
        self.tokenizer, self.script, self.pieces = tokenizer, script, pieces
        self.context_len, self.max_total_tokens = context_len, 4 * context_len
        self.info = {"architecture": "DeepseekV3ForCausalLM", "context_length": context_len}
        self.requests: list = []
        self.aborted: list[int] = []

    def prepare(self, obj):
        return obj

    async def check_grammars(self, reqs) -> None:
        """Scripted output follows no grammar: nothing to check."""

    async def generate(self, obj):
        import asyncio

        index = len(self.requests)
        self.requests.append(obj)
        text = self.script(index, obj)
        ids = obj.input_ids if obj.input_ids is not None else self.tokenizer.encode(obj.text)
        cuts = sorted({0, len(text), *(len(text) * k // self.pieces for k in range(1, self.pieces))})
        done = False
        try:
            for a in cuts[1:] or [0]:
                await asyncio.sleep(0)
                done = a == len(text)
                if obj.stream or done:
                    yield self.snapshot(text[:a], ids, done)
        finally:
            if not done:
                self.aborted.append(index)

    def snapshot(self, text: str, ids: list[int], done: bool) -> dict:
        out_ids = self.tokenizer.encode(text, add_bos=False)
        meta = {"id": "scripted", "finish_reason": {"type": "stop", "matched": 1} if done else None,
                "prompt_tokens": len(ids), "completion_tokens": len(out_ids), "cached_tokens": 0}
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    async def get_stats(self) -> dict:
        return {"num_running_reqs": 0}

    async def flush_cache(self) -> bool:
        return True


@pytest.fixture(scope="session")
def demo_tokenizer(demo_cache: Path):
    from mlaserve.server.launch import demo_model_path
    from mlaserve.tokenizer import load_tokenizer

    return load_tokenizer(demo_model_path())


@pytest.fixture
def scripted_app(demo_tokenizer):
    """Factory: (script, **server flags) -> (TestClient, ScriptedManager) for an app on a ScriptedManager."""
    from fastapi.testclient import TestClient

    from mlaserve.config import ServerConfig
    from mlaserve.server.openai import create_app

    clients = []

    def make(script: Callable, **flags):
        manager = ScriptedManager(demo_tokenizer, script)
        app = create_app(manager, demo_tokenizer, ServerConfig.from_flat(**flags), model_path="scripted")
        client = TestClient(app)
        clients.append(client)
        return client, manager

    yield make
    for c in clients:
        c.close()
