"""The OpenAI-compatible and native APIs against a real `mlaserve serve` on the demo model (official `openai`
client and raw HTTP), and the tool-call / reasoning paths of the HTTP layer on scripted model text."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from mlaserve.tokenizer import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP

MODEL = "mlaserve-demo"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
USER = [{"role": "user", "content": "Tell me a story about a river."}]
LOGPROB_TOL = 1e-4  # fp32 CPU model: the chosen token's log-prob equals the top-1 log-prob up to rounding


def sse_objects(text: str) -> list[dict]:
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# --- real server -------------------------------------------------------------------------------------------

def test_models_say_what_the_demo_is(oai):
    (card,) = oai.models.list().data
    assert card.id == "mlaserve-demo"
    assert "trained on Python source" in card.owned_by


def test_chat_whole_and_streamed_agree(oai, http):
    whole = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, **GREEDY)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    n_prompt = http.post("/tokenize", json={"prompt": USER}).json()["count"]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_prompt, 6)

    chunks = list(oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens > 0   # the same prompt again: served from the prefix cache


def test_completions_text_ids_echo_and_stream(oai, http):
    prompt = "The river flows"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_text = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **GREEDY).choices[0].text
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY).choices[0].text
    assert by_text == by_ids and by_text
    echo = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, **GREEDY).choices[0].text
    assert echo == prompt + by_text
    streamed = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_text


def test_chat_logprobs_are_greedy_top1(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert t.logprob == pytest.approx(tops[0], abs=LOGPROB_TOL)


def test_completion_echo_logprobs_cover_prompt_and_output(oai, http):
    prompt = "Rivers run to the sea"
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 4
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])


def test_n_choices_with_seed(oai):
    kw = dict(model=MODEL, messages=USER, max_tokens=8, n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    a, b = oai.chat.completions.create(**kw), oai.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]      # seed + i per choice: reproducible
    assert len(set(texts)) > 1                                   # ... and the choices differ
    assert a.usage.completion_tokens == 24
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert streamed == texts


def test_stop_string_trims_and_reports_stop(oai):
    text = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=16, **GREEDY).choices[0].message.content
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip())
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=16, stop=[stop], **GREEDY)
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_native_generate_whole_and_streamed(http):
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    whole = http.post("/generate", json=body).json()
    assert len(whole["output_ids"]) == 6 and whole["meta_info"]["finish_reason"]["type"] == "length"
    events = sse_objects(http.post("/generate", json={**body, "stream": True}).text)
    assert [e["text"] for e in events] == sorted((e["text"] for e in events), key=len)   # cumulative
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    batch = http.post("/generate", json={**body, "text": ["Hello there", "Goodbye"]}).json()
    assert len(batch) == 2 and batch[0]["output_ids"] == whole["output_ids"]


def test_tokenize_detokenize_roundtrip(http):
    ids = http.post("/tokenize", json={"prompt": "a river, a sea", "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["text"] == "a river, a sea"


def test_info_health_and_cache_endpoints(http, server):
    info = http.get("/get_model_info").json()
    assert info["random_weights"] is False and info["context_length"] == server.context_len    # the trained demo
    got = http.get("/get_server_info").json()
    assert got["max_total_tokens"] == 4096 and got["context_length"] == server.context_len
    assert got["scheduler_pid"] > 0 and "num_running_reqs" in got and got["api_key"] == "<set>"
    resolved = [got[k] for k in ("device", "dtype", "attention_backend", "kv_cache_dtype", "load_format")]
    assert "auto" not in resolved and got["max_running_requests"] >= 1, resolved     # what runs, not "auto"
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.post("/flush_cache").json()["success"] is True
    assert http.get("/get_server_info").json()["cached_tokens_in_tree"] == 0


def test_metrics(http):
    http.post("/generate", json={"text": "metrics", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    text = http.get("/metrics").text
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert values["mlaserve:generation_tokens_total"] >= 3 and values["mlaserve:prompt_tokens_total"] > 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert values[f"mlaserve:{name}_count"] >= 1
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate"):
        assert f"mlaserve:{name}" in values


def test_64_concurrent_streams_equal_sequential_greedy(server, http):
    """Batched decoding must not change greedy output: 64 streamed clients at once == one at a time."""
    n_tokens = 8
    prompts = [[{"role": "user", "content": f"Item {i}: describe the river number {i * 7 % 64}."}] for i in range(64)]
    kw = dict(model=MODEL, max_tokens=n_tokens, logprobs=True, **GREEDY)

    async def one(client: openai.AsyncOpenAI, messages: list[dict]) -> list[str]:
        stream = await client.chat.completions.create(messages=messages, stream=True, **kw)
        return [t.token async for c in stream if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]

    async def run(together: bool) -> list[list[str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0,
                                      timeout=120) as client:
            if together:
                return list(await asyncio.gather(*(one(client, p) for p in prompts)))
            return [await one(client, p) for p in prompts]

    steps = http.get("/get_server_info").json()["steps"]
    together = asyncio.run(run(True))
    steps = http.get("/get_server_info").json()["steps"] - steps
    alone = asyncio.run(run(False))
    assert steps <= len(prompts) * n_tokens // 4, "the concurrent requests were not batched"
    assert all(len(t) == n_tokens for t in alone)
    assert together == alone


# --- HTTP-layer parsing on scripted model text -------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]


def v3_call(name: str, args: dict) -> str:
    return f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n{json.dumps(args)}\n```{TOOL_CALL_END}"


TWO_CALLS = ("Let me check." + TOOL_CALLS_BEGIN + v3_call("get_weather", {"city": "Paris"}) + "\n"
             + v3_call("get_time", {"tz": "CET"}) + TOOL_CALLS_END)


def client_for(app_client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=app_client, max_retries=0)


def streamed_chat(client: openai.OpenAI, **kw) -> tuple[str, str, dict, str]:
    """(content, reasoning, {index: (name, arguments)}, finish_reason) assembled from the stream."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in client.chat.completions.create(model=MODEL, stream=True, **kw):
        d = c.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        finish = c.choices[0].finish_reason or finish
    return content, reasoning, calls, finish


def test_tool_calls_whole_and_streamed(scripted_app):
    app, _ = scripted_app(lambda i, obj: TWO_CALLS, tool_call_parser="deepseekv3")
    client = client_for(app)
    msg = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS).choices
    assert msg[0].finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg[0].message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert msg[0].message.content == "Let me check."
    content, _, streamed, finish = streamed_chat(client, messages=USER, tools=TOOLS)
    assert content == "Let me check." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in (streamed[i] for i in sorted(streamed))] == calls


def test_reasoning_runs_before_tool_parsing(scripted_app):
    text = "The user wants weather.\n</think>\n\nSure." + TWO_CALLS.removeprefix("Let me check.")
    app, _ = scripted_app(lambda i, obj: text, tool_call_parser="deepseekv3", reasoning_parser="deepseek-r1")
    client = client_for(app)
    m = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS).choices[0].message
    assert m.reasoning_content == "The user wants weather." and m.content == "Sure." and len(m.tool_calls) == 2
    content, reasoning, calls, finish = streamed_chat(client, messages=USER, tools=TOOLS)
    assert (content, reasoning, len(calls), finish) == ("Sure.", "The user wants weather.", 2, "tool_calls")


def test_tool_choice_none_and_named(scripted_app, demo_tokenizer):
    app, manager = scripted_app(lambda i, obj: TWO_CALLS, tool_call_parser="deepseekv3")
    client = client_for(app)
    m = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none").choices[0]
    assert m.message.tool_calls is None and TOOL_CALL_BEGIN in m.message.content and m.finish_reason == "stop"
    assert "get_weather" not in demo_tokenizer.decode(manager.requests[-1].input_ids, skip_special_tokens=False)
    named = {"type": "function", "function": {"name": "get_time"}}
    m = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=named).choices[0]
    assert [c.function.name for c in m.message.tool_calls] == ["get_time"]
    assert "get_weather" in m.message.content           # a call to another function stays text
    prompt = demo_tokenizer.decode(manager.requests[-1].input_ids, skip_special_tokens=False)
    assert "### get_time" in prompt and "### get_weather" not in prompt


def test_tool_results_go_back_through_the_template(scripted_app, demo_tokenizer):
    app, manager = scripted_app(lambda i, obj: "It is sunny.", tool_call_parser="deepseekv3")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "22C, sunny"}]
    r = client_for(app).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    prompt = demo_tokenizer.decode(manager.requests[-1].input_ids, skip_special_tokens=False)
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>22C, sunny<｜tool▁output▁end｜>" in prompt
    assert v3_call("get_weather", {"city": "Paris"}) in prompt


def test_malformed_tool_call_is_returned_as_content(scripted_app):
    bad = f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}function{TOOL_SEP}get_weather\n```json\n{{not json\n```{TOOL_CALL_END}"
    app, _ = scripted_app(lambda i, obj: bad, tool_call_parser="deepseekv3")
    client = client_for(app)
    m = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS).choices[0]
    assert m.message.tool_calls is None and "{not json" in m.message.content and m.finish_reason == "stop"
    content, _, calls, _ = streamed_chat(client, messages=USER, tools=TOOLS)
    assert calls == {} and content == m.message.content


def test_abort_request_ends_a_running_stream(http):
    """SGLang's /abort_request: a running request by rid (its stream ends with an abort finish), nothing for an
    unknown rid, one line for a body naming neither or both targets; a second stream of a running rid is a 400."""
    for body in ({}, {"rid": "x", "abort_all": True}):
        r = http.post("/abort_request", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"] == "give a rid or abort_all: true (not both)"
    r = http.post("/generate", json={"sampling_params": {}})              # a check of the whole body: its own line
    assert r.status_code == 400 and r.json()["error"]["message"] == "give exactly one of text and input_ids", r.text
    assert http.post("/abort_request", json={"rid": "nobody"}).json() == {"aborted": 0}
    body = {"text": "def", "rid": "long-1", "stream": True, "sampling_params": {"max_new_tokens": 1000,
                                                                             "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as r:
        events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(events))
        dup = http.post("/generate", json=body)               # the same rid while it runs: 400 before any stream
        assert dup.status_code == 400 and "'long-1' is already running" in dup.json()["error"]["message"], dup.text
        assert http.post("/abort_request", json={"rid": "long-1"}).json() == {"aborted": 1}
        rest = [e for e in events if e != "[DONE]"]
    last = json.loads(rest[-1]) if rest else first
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by an /abort_request call"}
    assert len(last["output_ids"]) < 1000
