"""Requests an audit of the HTTP server found mishandled: every valid seed works with any n, an error names the
fields in the API's own names, OpenAI's retrieve-model route answers, a /generate batch takes a list of rids."""
from __future__ import annotations

import pytest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "hi"})])
def test_the_largest_seed_works_with_several_choices(scripted_app, path, body):
    """Choice i samples with seed + i, wrapped within int64 (it was a 400 'seed must be <= 2**63 - 1' when the
    request sent exactly that)."""
    client, manager = scripted_app(lambda i, obj: "ok")
    r = client.post(path, json={**body, "n": 3, "seed": INT64_MAX, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert [obj.sampling_params.seed for obj in manager.requests] == [INT64_MAX, INT64_MIN, INT64_MIN + 1]
    r = client.post(path, json={**body, "n": 2, "seed": 7, "max_tokens": 2})
    assert [obj.sampling_params.seed for obj in manager.requests[3:]] == [7, 8]


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": USER, "max_tokens": 5, "min_tokens": 6}),
                                        (COMPLETIONS, {"prompt": "hi", "min_tokens": 20})])   # max_tokens: 16
def test_min_tokens_error_uses_the_openai_names(scripted_app, path, body):
    client, _ = scripted_app(lambda i, obj: "ok")
    r = client.post(path, json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens"
    assert "min_new_tokens" not in err["message"] and "max_new_tokens" not in err["message"], err["message"]
    assert err["message"].startswith("Invalid value for 'min_tokens': min_tokens (")


def test_retrieve_model(scripted_app):
    import openai

    client, _ = scripted_app(lambda i, obj: "ok")
    r = client.get("/v1/models/mlaserve-demo")
    assert r.status_code == 200 and r.json()["id"] == "mlaserve-demo" and r.json()["object"] == "model"
    assert client.get("/v1/models/scripted").json()["id"] == "mlaserve-demo"      # the model path too
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with openai.OpenAI(base_url="http://test/v1", api_key="x", http_client=client, max_retries=0) as oai:
        assert oai.models.retrieve("mlaserve-demo").id == "mlaserve-demo"


def test_generate_batch_takes_a_list_of_rids(scripted_app):
    """SGLang's /generate: a batch's rid is a list, one per prompt (a list was refused, and a string was dropped
    without a word)."""
    client, manager = scripted_app(lambda i, obj: "ok")
    r = client.post("/generate", json={"text": ["a", "b"], "rid": ["r1", "r2"]})
    assert r.status_code == 200 and [obj.rid for obj in manager.requests] == ["r1", "r2"]
    r = client.post("/generate", json={"text": "a", "rid": "one"})
    assert r.status_code == 200 and manager.requests[-1].rid == "one"
    for body in ({"text": ["a", "b"], "rid": "same"}, {"text": ["a", "b"], "rid": ["r1"]},
                 {"input_ids": [[5], [6]], "rid": ["r", "r"]}, {"text": "a", "rid": ["r1"]},
                 {"text": ["a", "b"], "rid": []}):
        r = client.post("/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid", (body, r.text)
    assert len(manager.requests) == 3


HUGE = "ab c" * 250_000        # 1 MB of text: far over the context, and seconds of tokenizing


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": HUGE}, "prompt"), (COMPLETIONS, {"prompt": ["hi", HUGE]}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": HUGE}]}, "messages")])
def test_a_huge_prompt_is_refused_before_tokenizing(scripted_app, demo_tokenizer, monkeypatch, path, body, param):
    """A prompt text surely longer than the context is refused from its length alone: tokenizing megabytes held up
    every other request (the event loop) for seconds, a minute for 50 MB."""
    encode = demo_tokenizer.encode

    def small_only(text, *a, **kw):
        assert len(text) < 100_000, "a huge prompt was tokenized"
        return encode(text, *a, **kw)

    monkeypatch.setattr(demo_tokenizer, "encode", small_only)
    client, manager = scripted_app(lambda i, obj: "ok")
    r = client.post(path, json={**body, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "at least" in err["message"], r.text
    assert not manager.requests
    assert client.post(COMPLETIONS, json={"prompt": "river " * 100, "max_tokens": 1}).status_code == 200


def test_min_tokens_is_a_lower_bound(demo_tokenizer):
    for text in ("", "hi", "ab c" * 100, " " * 500, "<｜begin▁of▁sentence｜>" * 5, "0123456789" * 20, "é∑😀" * 30):
        assert demo_tokenizer.min_tokens(text) <= len(demo_tokenizer.encode(text, add_bos=False)), text


def test_generate_refuses_a_huge_text_before_tokenizing(demo_tokenizer, tmp_path):
    from mlaserve.server.manager import GenerateInput, RequestError, TokenizerManager

    info = {"context_length": 256, "max_total_tokens": 512, "vocab_size": demo_tokenizer.vocab_size}
    manager = TokenizerManager(demo_tokenizer, f"ipc://{tmp_path}/r", f"ipc://{tmp_path}/o", info)
    try:
        with pytest.raises(RequestError) as e:
            manager.prepare(GenerateInput(text=HUGE))
        assert e.value.param == "text" and "at least" in e.value.message
        assert manager.prepare(GenerateInput(text="hi")).input_ids          # a short one still passes
    finally:
        manager.ctx.destroy(linger=0)


@pytest.mark.parametrize("path, body, param, words", [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text",
     "Field required"),
    (CHAT, {"messages": USER, "tool_choice": {"type": "function"}}, "tool_choice.function", "Field required"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt[1]", "valid integer"),
    (COMPLETIONS, {"prompt": None}, "prompt", "valid string; or Input should be a valid list"),
    ("/generate", {"text": ["a", 1]}, "text[1]", "valid string"),
])
def test_a_union_error_names_the_member_that_got_furthest(scripted_app, path, body, param, words):
    """A value that fails every member of a union was answered with the first member's complaint ("content: Input
    should be a valid string" for a content part without its text); the member that got deepest names the cause."""
    client, _ = scripted_app(lambda i, obj: "ok")
    r = client.post(path, json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text


def test_tokenize_refuses_an_empty_chat(scripted_app):
    client, _ = scripted_app(lambda i, obj: "ok")
    r = client.post("/tokenize", json={"prompt": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = client.post("/tokenize", json={"prompt": USER})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_a_body_over_the_limit_is_refused_as_it_arrives(scripted_app, monkeypatch):
    """413 with OpenAI's error body, whether the client declares the length or streams the body in chunks; the
    server keeps serving."""
    from mlaserve.server import openai as server_openai

    monkeypatch.setattr(server_openai, "MAX_BODY_BYTES", 1 << 20)
    client, _ = scripted_app(lambda i, obj: "ok")
    big = {"prompt": "x" * (1 << 20)}
    r = client.post(COMPLETIONS, json=big)
    assert r.status_code == 413 and "limit of 1 MiB" in r.json()["error"]["message"], r.text

    def chunks():                                       # no Content-Length: counted as the bytes arrive
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * (64 << 10)
        yield b'"}'

    r = client.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
