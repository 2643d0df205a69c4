"""Property-based fuzzing of the request schemas (native /generate, OpenAI chat and completions) against the real
server: any field set to any JSON value (wrong types, huge or negative numbers, NaN, lone surrogates, nesting)
gets a 2xx or a 4xx naming a field, never a 5xx, never a hang; a normal request succeeds after every case."""
from __future__ import annotations

import json
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from mlaserve.core import SamplingParams
from mlaserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

SEED = random.randrange(2**32)
EXAMPLES = 100                 # per route: CI time
TIMEOUT_S = 60.0               # a request slower than this is a hang (a valid case generates < 16 tokens)
SMALL = {"max_tokens": 2, "temperature": 0}

# any JSON value, weighted toward what breaks servers: wrong types, edges of int32 / int64, NaN, surrogates
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3),
    st.sampled_from([-1, 2**31, -(2**31) - 1, 2**63, 2**64, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from(["\ud800", "abc\udfff", "", "0", "1e9", "true", "null"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.one_of(st.text(max_size=4), st.sampled_from(["0", "5", "-1", "999999999"])), inner, max_size=3), max_leaves=6)


def fields(model) -> list[str]:
    return sorted(model.model_fields)


def bodies(base: dict, names: list[str], nested: tuple[str, list[str]] | None = None):
    """`base` with one to three of its schema's fields (or of a nested object's) set to fuzzed values."""
    def build(top: dict, inner: dict) -> dict:
        body = {**base, **top}
        if nested and inner and nested[0] not in top:      # a fuzzed whole object wins over fuzzed fields
            body[nested[0]] = {**base[nested[0]], **inner}
        return body

    inner = st.dictionaries(st.sampled_from(nested[1]), VALUES, max_size=3) if nested else st.just({})
    return st.builds(build, st.dictionaries(st.sampled_from(names), VALUES, max_size=3), inner)


def send(http: httpx.Client, path: str, body: dict) -> None:
    """One fuzzed request: its answer is a 2xx, or a 4xx in OpenAI's error shape; a stream ends cleanly."""
    raw = json.dumps(body)           # NOTE: NaN and lone surrogates travel as JSON allows them
    r = http.post(path, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    assert r.status_code < 500, f"{r.status_code} for {raw[:300]}: {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] in (r.status_code, "model_not_found") and err["message"], r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]", r.text[-300:]
        assert not any('"error"' in e and '"code": 5' in e for e in events), r.text[-300:]
    r = http.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 1}}, timeout=TIMEOUT_S)
    assert r.status_code == 200, f"the server stopped serving after {raw[:300]}: {r.text[:300]}"


@pytest.fixture(scope="module")
def http(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=TIMEOUT_S, trust_env=False) as client:
        yield client


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


def test_generate_schema(http):
    print(f"hypothesis seed {SEED}")
    base = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}

    @seed(SEED)
    @FUZZ
    @given(bodies(base, fields(GenerateRequest), ("sampling_params", fields(SamplingParams))))
    def run(body):
        send(http, "/generate", body)

    run()


def test_chat_schema(http):
    print(f"hypothesis seed {SEED}")
    base = {"messages": {"role": "user", "content": "hi"}, **SMALL}     # the one message goes in a list below
    names = fields(ChatCompletionRequest)

    @seed(SEED)
    @FUZZ
    @given(bodies(base, names, ("messages", ["role", "content", "name", "tool_calls", "tool_call_id"])))
    def run(body):
        if isinstance(body.get("messages"), dict):
            body["messages"] = [body["messages"]]
        send(http, "/v1/chat/completions", body)

    run()


def test_completions_schema(http):
    print(f"hypothesis seed {SEED}")
    base = {"prompt": "hi", **SMALL}

    @seed(SEED)
    @FUZZ
    @given(bodies(base, fields(CompletionRequest)))
    def run(body):
        send(http, "/v1/completions", body)

    run()
