"""The offline Engine API over the real scheduler process (ZeroMQ), on the CPU."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mlaserve
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    d = json.loads((CONFIGS / "deepseek-v3.json").read_text()) | {"first_k_dense_replace": 1}
    cfg = make_config(d, num_layers=2, shrink=True, fp8=False)
    return str(write_checkpoint(cfg, tmp_path_factory.mktemp("eng") / "m", progress=False))


@pytest.fixture(scope="module")
def engine(ckpt):
    with mlaserve.Engine(model_path=ckpt, device="cpu", dtype="float32", max_total_tokens=2048,
                         log_level="warning") as e:
        yield e


def test_generate_single_and_batch_shapes(engine):
    one = engine.generate(prompt="Hello world", sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert set(one) == {"text", "output_ids", "meta_info"} and len(one["output_ids"]) == 5
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5} and meta["completion_tokens"] == 5
    batch = engine.generate(prompt=["Hello world", "A second prompt"], sampling_params={"max_new_tokens": 4,
                                                                                        "temperature": 0})
    assert isinstance(batch, list) and batch[0]["output_ids"][:4] == one["output_ids"][:4]
    ids = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=[{"max_new_tokens": 2}, {"max_new_tokens": 3}])
    assert [len(o["output_ids"]) for o in ids] == [2, 3]


def test_prompt_logprobs_equal_hf(engine, ckpt):
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(20, 4000, (30,)).tolist()
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=3)
    got = out["meta_info"]["input_token_logprobs"]
    assert got[0] == (None, ids[0]) and [t for _, t in got] == ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert max(abs(a - b) for (a, _), b in zip(got[1:], want.tolist())) <= 1e-4
    tops = out["meta_info"]["input_top_logprobs"]
    assert len(tops) == len(ids) - 1 and all(len(t) == 3 and t[0][0] >= t[1][0] >= t[2][0] for t in tops)
    # from a later position, with the prefix cache warm: same values
    again = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                            logprob_start_len=10)["meta_info"]["input_token_logprobs"]
    assert [t for _, t in again] == ids[10:]
    assert max(abs(a - b) for (a, _), (b, _) in zip(again, got[10:])) <= 1e-5


def test_streaming_and_async(engine):
    chunks = list(engine.generate(prompt="stream me", sampling_params={"max_new_tokens": 6, "temperature": 0},
                                  stream=True))
    final = engine.generate(prompt="stream me", sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert len(chunks) >= 2 and all(a["text"] == b["text"][: len(a["text"])] for a, b in zip(chunks, chunks[1:]))

    async def go():
        res = await engine.async_generate(prompt=["x y", "z"], sampling_params={"max_new_tokens": 3})
        parts = [c async for c in await engine.async_generate(prompt="x y", sampling_params={"max_new_tokens": 3},
                                                             stream=True)]
        return res, parts
    res, parts = asyncio.run(go())
    assert len(res) == 2 and parts[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_strings_trim_and_report(engine):
    base = engine.generate(prompt="stop test", sampling_params={"max_new_tokens": 12, "temperature": 0})
    text = base["text"]
    assert len(text) > 6
    stop = text[3:6]
    out = engine.generate(prompt="stop test", sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": stop})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_bad_request_raises_clear_error(engine):
    from mlaserve.server.manager import RequestError
    for params, field in [({"temperature": -1}, "sampling_params.temperature"),
                          ({"stop_token_ids": 5}, "sampling_params.stop_token_ids"),
                          ({"seed": "abc"}, "sampling_params.seed"), ([{}, {}], "sampling_params")]:
        with pytest.raises(RequestError, match=field.split(".")[-1]) as e:
            engine.generate(prompt="x", sampling_params=params)
        assert e.value.param == field
    with pytest.raises(RequestError) as e:
        engine.generate(input_ids=[5, "6"])
    assert e.value.param == "input_ids[1]"
    with pytest.raises(RequestError, match="more than the KV cache holds"):
        engine.generate(input_ids=[5] * 3000)
    with pytest.raises(RequestError, match="token ids must be in"):
        engine.generate(input_ids=[5, 99999])
    assert engine.generate(prompt="still serving", sampling_params={"max_new_tokens": 1})["output_ids"]


def test_server_info_reports_resolved_values(engine):
    info = engine.get_server_info()
    assert (info["device"], info["dtype"], info["attention_backend"], info["kv_cache_dtype"]) == \
        ("cpu", "float32", "torch", "float32")
    assert (info["max_total_tokens"], info["max_running_requests"], info["disable_cuda_graph"]) == (2048, 64, True)
    assert info["context_length"] > 0 and info["load_format"] == "safetensors" and info["cuda_graph_bs"] == []


def test_warm_up_runs_before_ready_and_leaves_nothing_behind(engine, ckpt):
    """The warm-up requests (a prompt, then its prefix-cache hit) ran before the scheduler reported ready; their
    cache and counters are gone; --skip-server-warmup skips them."""
    info = engine.get_server_info()
    assert info["warmup_s"] > 0 and info["skip_server_warmup"] is False
    with mlaserve.Engine(model_path=ckpt, device="cpu", dtype="float32", max_total_tokens=2048,
                         log_level="warning") as fresh:
        info = fresh.get_server_info()
        assert info["warmup_s"] > 0
        assert (info["prompt_tokens"], info["generation_tokens"], info["cached_tokens"], info["steps"]) == (0, 0, 0, 0)
        assert info["used_tokens"] == 0 and info["cached_tokens_in_tree"] == 0
    with mlaserve.Engine(model_path=ckpt, device="cpu", dtype="float32", max_total_tokens=2048,
                         log_level="warning", skip_server_warmup=True) as cold:
        info = cold.get_server_info()
        assert info["warmup_s"] is None and info["skip_server_warmup"] is True
        assert cold.generate(prompt="Hi", sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_unsupported_parallel_engine_is_rejected_not_ignored(ckpt):
    from mlaserve.config import ConfigError
    with pytest.raises(ConfigError, match="--tp-size 8: .* has 4 heads"):          # the test model has 4 heads
        mlaserve.Engine(model_path=ckpt, device="cpu", tp_size=8)
    with pytest.raises(ConfigError, match="--dp-size 2"):
        mlaserve.Engine(model_path=ckpt, device="cpu", dp_size=2)
    with pytest.raises(ConfigError, match="--port, --enable-metrics: HTTP server options"):
        mlaserve.Engine(model_path=ckpt, device="cpu", port=8000, enable_metrics=True)


def test_issue_one_liner(ckpt):
    code = ("import mlaserve; e = mlaserve.Engine(model_path=%r, device='cpu'); "
            "print(e.generate(prompt='Hi', sampling_params={'max_new_tokens': 8})); e.shutdown()" % ckpt)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'completion_tokens': 8" in out.stdout


def test_dead_scheduler_raises_instead_of_waiting(ckpt):
    import os
    import signal
    import time

    from mlaserve.server.manager import EngineDeadError

    with mlaserve.Engine(model_path=ckpt, device="cpu", dtype="float32", max_total_tokens=1024,
                         log_level="warning") as e:
        stream = e.generate(prompt="go", sampling_params={"max_new_tokens": 500, "ignore_eos": True}, stream=True)
        next(stream)
        os.kill(e.handle.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="scheduler process is not running"):
            for _ in stream:     # the request in flight fails ...
                pass
        with pytest.raises(EngineDeadError):
            e.generate(prompt="later", sampling_params={"max_new_tokens": 2})   # ... and so does every later one
        assert time.monotonic() - start < 60, "the engine waited on a dead scheduler"


def test_structured_output_through_the_engine(engine):
    from mlaserve.core import RequestError

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    outs = engine.generate(prompt=["a", "b", "c"], sampling_params=[
        {"json_schema": json.dumps(schema), "seed": 1, "max_new_tokens": 40},
        {"regex": "(red|green)-[0-9]{2}", "seed": 2, "max_new_tokens": 40},
        {"ebnf": 'root ::= "x" ("y" | "z")', "seed": 3, "max_new_tokens": 40}])
    assert json.loads(outs[0]["text"])["n"] in range(10)
    import re

    assert re.fullmatch("(red|green)-[0-9]{2}", outs[1]["text"]) and outs[2]["text"] in ("xy", "xz")
    with pytest.raises(RequestError) as info:
        engine.generate(prompt="a", sampling_params={"ebnf": "root ::= ("})
    assert info.value.param == "sampling_params.ebnf"
    with pytest.raises(RequestError) as info:
        engine.generate(prompt="a", sampling_params={"regex": "a", "json_schema": "{}"})
    assert "at most one" in info.value.message


def test_truncate_and_stream_interval_at_tp2_equal_tp1(ckpt, engine):
    """--allow-auto-truncate and --stream-interval 3 on two gloo ranks: a prompt past the 256-token context runs
    on its first 255 tokens with the tokens the single process gives that head (fp32, greedy), and a stream's
    snapshots hold the first token, then 3 more each, then the rest."""
    long = [5 + i % 3000 for i in range(400)]
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with mlaserve.Engine(model_path=ckpt, device="cpu", dtype="float32", max_total_tokens=2048, context_length=256,
                         tp_size=2, allow_auto_truncate=True, stream_interval=3, log_level="error") as tp2:
        got = tp2.generate(input_ids=long, sampling_params=greedy | {"max_new_tokens": 1000})
        snaps = list(tp2.generate(input_ids=long[:20], sampling_params=greedy, stream=True))
    head = engine.generate(input_ids=long[:255], sampling_params=greedy | {"max_new_tokens": 1})
    assert got["meta_info"]["prompt_tokens"] == 255 and got["output_ids"] == head["output_ids"]
    lens = [len(s["output_ids"]) for s in snaps]
    assert lens[-1] == 8 and all(n % 3 == 1 for n in lens[:-1])
    assert snaps[-1]["output_ids"] == engine.generate(input_ids=long[:20], sampling_params=greedy)["output_ids"]
