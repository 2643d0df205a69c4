"""schemathesis against the live server's /openapi.json: every POST route, fed bodies that violate its published
schema, answers 4xx (never 5xx, never a hang) and the server keeps serving. (Valid bodies are fuzzed by
test_fuzz.py: schemathesis' own valid ones, up to n=64 choices each, took over 7 minutes on the CPU.)"""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis", reason="in the test extra: pip install -e '.[test]'")

EXAMPLES = 20           # per route: CI time
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return fuzz_server.url, schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


ROUTES = ["/generate", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("path", ROUTES)
def test_published_schema(api_schema, path):
    # NOTE: the strategy of each operation in a test of our own (schemathesis' pytest plugin needs an older pytest)
    url, schema = api_schema
    operation = schema[path]["POST"]

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))      # schema-violating bodies
    def run(case):
        r = case.call(base_url=url, timeout=TIMEOUT_S)
        assert 400 <= r.status_code < 500, f"{r.status_code} for {path} {case.body!r:.300}: {r.text[:300]}"
        ok = httpx.post(url + "/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 1}},
                        timeout=TIMEOUT_S, trust_env=False)
        assert ok.status_code == 200, f"the server stopped serving after {case.body!r:.300}"

    run()
