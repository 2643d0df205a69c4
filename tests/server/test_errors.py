"""Bad requests get a 4xx with OpenAI's error body naming the field, and the server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LONG = " ".join(["river"] * 1500)   # > 1024 tokens: longer than the shared server's context

BAD = [  # (path, body, param the error must name)
    (CHAT, {}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0]"),
    (CHAT, {"messages": USER, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": "ten"}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 10**9}, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": 10**12}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "temperature": 2.5}, "temperature"),
    (CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": USER, "top_p": 0}, "top_p"),
    (CHAT, {"messages": USER, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": USER, "n": 0}, "n"),
    (CHAT, {"messages": USER, "frequency_penalty": 3}, "frequency_penalty"),
    (CHAT, {"messages": USER, "top_k": 0}, "top_k"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, "top_logprobs"),                  # without logprobs: true
    (CHAT, {"messages": USER, "stream": "yes"}, "stream"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    (CHAT, {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    (CHAT, {"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": USER, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),  # no --tool-call-parser
    (COMPLETIONS, {"prompt": "hi", "suffix": "bye"}, "suffix"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 2, 10**7]}, "prompt"),
    (COMPLETIONS, {"prompt": LONG}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 1023}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, None),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"warmth": 1}}, "sampling_params.warmth"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -5}, "logprob_start_len"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{p}-{w}" for p, _, w in BAD])
def test_bad_request_names_the_field(http, path, body, param):
    r = http.post(path, json={"model": "mlaserve-demo", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["message"]


def test_an_image_part_is_named_as_such(http):
    """A content part other than text: the message says so, not the union's first complaint ("a valid string")."""
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = http.post(CHAT, json={"model": "mlaserve-demo", "messages": [{"role": "user", "content": parts}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[0].content"
    assert "content parts of type 'image_url' are not supported" in err["message"]


def test_malformed_json(http):
    r = http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_wrong_or_missing_api_key(server):
    for headers in ({"Authorization": "Bearer wrong"}, {}):
        r = httpx.post(server.url + CHAT, json={"messages": USER}, headers=headers, trust_env=False)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200   # probes need no key
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_unknown_route_has_the_error_shape(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_openai_client_sees_param_and_server_keeps_serving(oai, http):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="mlaserve-demo", messages=USER, temperature=9)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:   # a stream is refused before it starts, with a 400
        oai.chat.completions.create(model="mlaserve-demo", messages=USER, max_tokens=-3, stream=True)
    assert e.value.param == "max_tokens"
    r = oai.chat.completions.create(model="mlaserve-demo", messages=USER, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert http.get("/health").status_code == 200
