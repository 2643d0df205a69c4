"""Requests that once crashed, wedged or hung the server (issue 10's fuzzing findings) get a 4xx naming the field
and the server keeps serving; logit_bias, max_tokens=0 and unknown model names behave as OpenAI / SGLang's do;
a request larger than the KV pool is refused or ends; an error inside a stream reaches the client."""
from __future__ import annotations

import glob
import json
import os
import tempfile
import time

import httpx
import pytest
import zmq

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
USER = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "ignore_eos": True}

FOUND = [  # (path, body, param the 400 must name)
    (GENERATE, {"text": "hi", "sampling_params": {"seed": "abc"}}, "sampling_params.seed"),
    (GENERATE, {"text": "hi", "sampling_params": {"min_new_tokens": 10**30}}, "sampling_params.min_new_tokens"),
    (GENERATE, {"text": "hi", "sampling_params": {"stop_token_ids": "x"}}, "sampling_params.stop_token_ids"),
    (GENERATE, {"text": "hi", "sampling_params": {"stop_token_ids": 5}}, "sampling_params.stop_token_ids"),
    (GENERATE, {"text": "hi", "sampling_params": {"stop": 5}}, "sampling_params.stop"),
    (GENERATE, {"text": "hi", "sampling_params": {"skip_special_tokens": "no"}},
     "sampling_params.skip_special_tokens"),
    (GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 4}},
     "sampling_params.min_new_tokens"),
    (GENERATE, {"text": "hi", "sampling_params": [{"max_new_tokens": 1}, {}]}, "sampling_params"),
    (GENERATE, {"text": "hi", "sampling_params": {"logit_bias": {"5": 101}}}, "sampling_params.logit_bias"),
    (GENERATE, {"text": "hi", "sampling_params": {"logit_bias": {"99999999": 1}}}, "logit_bias"),
    (GENERATE, {"input_ids": [-1]}, "input_ids"),
    (GENERATE, {"input_ids": [[5, 6], [7, -1]]}, "input_ids"),
    (GENERATE, {"text": ["a", "b"], "stream": True}, "stream"),
    (CHAT, {"messages": USER, "skip_special_tokens": "no"}, "skip_special_tokens"),
    (CHAT, {"messages": USER, "stop": 5}, "stop"),
    (CHAT, {"messages": USER, "stop": [5]}, "stop[0]"),
    (CHAT, {"messages": USER, "seed": "abc"}, "seed"),
    (CHAT, {"messages": USER, "min_tokens": 10**30}, "min_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    (CHAT, {"messages": USER, "stop_token_ids": 5}, "stop_token_ids"),
    (CHAT, {"messages": USER, "logit_bias": {"1": -101}}, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"token": 1}}, "logit_bias.token"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs"),
    (CHAT, {"messages": USER, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    (CHAT, {"messages": USER, "temperature": float("nan")}, "temperature"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (CHAT, {"messages": USER, "stop": ["\udfff"]}, "stop[0]"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"x": "\ud800"}}, "chat_template_kwargs"),
    (COMPLETIONS, {"prompt": [-1]}, "prompt"),
    (COMPLETIONS, {"prompt": [[5], [6, -1]], "echo": True}, "prompt"),
    (COMPLETIONS, {"prompt": "\ud800"}, "prompt"),
]


def post(http: httpx.Client, path: str, body: dict, **kw) -> httpx.Response:
    # NOTE: serialised here: httpx refuses NaN and lone surrogates, which a client may well send
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}, **kw)


def still_serving(http: httpx.Client) -> None:
    r = http.post(GENERATE, json={"text": "ok", "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


@pytest.mark.parametrize("path, body, param", FOUND, ids=[f"{p}-{w}" for p, _, w in FOUND])
def test_found_by_fuzzing_gets_400_naming_the_field(http, path, body, param):
    r = post(http, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "invalid_request_error", err


def test_server_keeps_serving_after_every_case(http):
    for path, body, _ in FOUND:
        assert post(http, path, body).status_code == 400
    still_serving(http)
    assert http.get("/health").status_code == 200


def test_odd_chat_template_kwargs_render_or_get_400(http):
    for kwargs in ({"thinking": {"a": [1, None]}}, {"": 1}, {"tools_hint": [1, 2]}, {"thinking": True}):
        r = post(http, CHAT, {"messages": USER, "max_tokens": 1, "chat_template_kwargs": kwargs})
        assert r.status_code in (200, 400), r.text


def test_unknown_model_is_404_model_not_found(http, server):
    r = http.post(CHAT, json={"model": "gpt-4", "messages": USER, "max_tokens": 1})
    assert r.status_code == 404
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "model",
                                                   "code": "model_not_found"}
    for name in ("mlaserve-demo", str(server.model_path), None):
        body = {"prompt": "hi", "max_tokens": 1} | ({"model": name} if name else {})
        assert http.post(COMPLETIONS, json=body).status_code == 200, name


def first_token(http: httpx.Client, ids: list[int], bias: dict | None = None) -> int:
    params = {"max_new_tokens": 1, **GREEDY} | ({"logit_bias": bias} if bias else {})
    r = http.post(GENERATE, json={"input_ids": ids, "sampling_params": params})
    return r.json()["output_ids"][0]


def test_logit_bias_forces_and_bans_tokens(http):
    ids = [5, 17, 200, 31]
    top = first_token(http, ids)
    other = (top + 11) % 4000 + 20
    assert first_token(http, ids, {str(other): 100}) == other
    assert first_token(http, ids, {str(top): -100}) != top
    r = http.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 3, "logit_bias": {str(other): 100}, **GREEDY})
    want = http.post("/detokenize", json={"tokens": [other] * 3, "skip_special_tokens": True}).json()["text"]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_zero_max_tokens_scores_the_prompt_on_every_route(http):
    prompt = "The river flows"
    n = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    native = http.post(GENERATE, json={"text": prompt, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": 0}).json()
    assert native["output_ids"] == [] and native["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(native["meta_info"]["input_token_logprobs"]) == n
    comp = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    choice = comp["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][1:] == [lp for lp, _ in native["meta_info"]["input_token_logprobs"][1:]]
    chat = http.post(CHAT, json={"messages": USER, "max_tokens": 0}).json()
    assert chat["choices"][0]["message"]["content"] == "" and chat["usage"]["completion_tokens"] == 0


def test_requests_larger_than_the_kv_pool(start_server):
    srv = start_server("--max-total-tokens", "256", "--context-length", "1024")
    with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as http:
        r = http.post(CHAT, json={"messages": USER, "max_tokens": 600, **GREEDY})   # pool < 600 < context
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "KV cache holds 256 tokens" in r.json()["error"]["message"]
        r = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": None, **GREEDY})   # as many as fit
        usage = r.json()["usage"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
        # together over the pool, each alone within it: retraction, and all of them finish
        bodies = [{"prompt": f"story {i}", "max_tokens": 120, **GREEDY} for i in range(4)]
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
            import concurrent.futures as cf
            with cf.ThreadPoolExecutor(4) as ex:
                outs = list(ex.map(lambda b: c.post(COMPLETIONS, json=b), bodies))
        assert [o.json()["usage"]["completion_tokens"] for o in outs] == [120] * 4


def test_dead_receive_loop_fails_health_and_exits_nonzero(start_server):
    srv = start_server("--max-total-tokens", "512", "--context-length", "512")
    (out_addr,) = glob.glob(os.path.join(tempfile.gettempdir(), f"mlaserve-{srv.proc.pid}-*-out"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"ipc://{out_addr}")
    sock.send(b"not a pickle")          # what no scheduler sends: the manager's receive loop dies
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            r = httpx.get(srv.url + "/health", trust_env=False, timeout=2)
        except httpx.TransportError:
            break
        if r.status_code == 503:
            assert "receive loop failed" in r.json()["error"]["message"]
            break
        time.sleep(0.05)
    ctx.destroy(linger=0)
    assert srv.proc.wait(30) != 0
    assert "receive loop failed" in srv.log()


# --- an error after a stream started: an error event, then [DONE] ------------------------------------------

def test_stream_error_reaches_the_client(scripted_app):
    def script(index, obj):
        raise RuntimeError("the model went away")

    client, _ = scripted_app(script)
    r = client.post(CHAT, json={"messages": USER, "stream": True})
    events = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and "the model went away" in err["message"]
    from fastapi.testclient import TestClient

    with TestClient(client.app, raise_server_exceptions=False) as whole:    # as a real server answers
        r = whole.post(CHAT, json={"messages": USER})
    assert r.status_code == 500 and "the model went away" in r.json()["error"]["message"]
