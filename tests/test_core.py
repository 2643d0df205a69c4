"""The request-facing core types: SamplingParams (the one declaration of the sampling parameters), check_request
(the one check of a tokenized request) and FinishReason."""
from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from mlaserve.core import FinishReason, RequestError, RequestLimits, SamplingParams, check_request, fit_request

BAD = [  # (field, value): each must be refused with an error naming the field
    ("seed", "abc"), ("seed", 2**64), ("seed", 1.5), ("min_new_tokens", 10**30), ("max_new_tokens", -1),
    ("max_new_tokens", 2**40), ("max_new_tokens", "8"), ("stop_token_ids", "x"), ("stop_token_ids", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [10**12]), ("stop", 5), ("stop", [5]), ("stop", "\ud800"),
    ("skip_special_tokens", "yes"), ("skip_special_tokens", 1), ("ignore_eos", None), ("temperature", "0.5"),
    ("temperature", True), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 2.5),
    ("temperature", -0.1), ("top_p", 0), ("top_p", 1.01), ("top_k", 0), ("top_k", -2), ("top_k", 2**40),
    ("min_p", 1.5), ("repetition_penalty", 0), ("frequency_penalty", 2.5), ("presence_penalty", -3),
    ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", [1]),
    ("no_stop_trim", "false"),
]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_wrong_type_or_range_names_the_field(name, value):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{name: value})
    assert e.value.errors()[0]["loc"][0] == name


def test_unknown_field_and_min_above_max_are_refused():
    with pytest.raises(ValidationError) as e:
        SamplingParams(warmth=1)
    assert e.value.errors()[0]["loc"] == ("warmth",)
    with pytest.raises(ValidationError, match="must not exceed max_new_tokens") as e:
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    assert e.value.errors()[0]["loc"] == ("min_new_tokens",)


def test_values_normalised_and_picklable():
    p = SamplingParams(temperature=0, stop="###", logit_bias={"7": -100, 9: 2.5}, seed=-(2**63))
    assert p.stop == ["###"] and p.logit_bias == {7: -100.0, 9: 2.5} and p.is_greedy and p.needs_sampler
    q = pickle.loads(pickle.dumps(p))      # crosses the process boundary as it is
    assert q == p and q.model_fields_set == p.model_fields_set
    assert not SamplingParams(temperature=0).needs_sampler


LIMITS = RequestLimits(context_len=100, max_total_tokens=60, vocab_size=1000)


def test_check_request_refuses_bad_prompts():
    for ids, match in [([], "empty"), ([5, -1], r"\[0, 1000\)"), ([5, 1000], r"\[0, 1000\)"),
                       ([1] * 100, "maximum context length"), ([1] * 60, "KV cache holds")]:
        with pytest.raises(RequestError, match=match) as e:
            check_request(ids, SamplingParams(), LIMITS)
        assert e.value.param == "input_ids" and e.value.status_code == 400
    with pytest.raises(RequestError) as e:
        check_request([1, 2], SamplingParams(logit_bias={1000: 1.0}), LIMITS)
    assert e.value.param == "logit_bias"


def test_check_request_resolves_or_refuses_max_new_tokens():
    ids = [1] * 10
    assert check_request(ids, SamplingParams(max_new_tokens=None), LIMITS).max_new_tokens == 50   # what fits
    assert check_request(ids, SamplingParams(), LIMITS).max_new_tokens == 50         # default 128, not asked for
    assert check_request(ids, SamplingParams(max_new_tokens=50), LIMITS).max_new_tokens == 50
    assert check_request(ids, SamplingParams(max_new_tokens=0), LIMITS).max_new_tokens == 0
    # asked for more than the KV pool holds (below the context length): refused, never left to grow forever
    with pytest.raises(RequestError, match="KV cache holds 60 tokens and the prompt has 10, so at most 50") as e:
        check_request(ids, SamplingParams(max_new_tokens=51), LIMITS)
    assert e.value.param == "max_new_tokens"
    assert e.value.renamed({"max_new_tokens": "max_tokens"}).message.startswith("max_tokens=51 is too large")
    with pytest.raises(RequestError, match="maximum context length is 100"):
        check_request(ids, SamplingParams(max_new_tokens=95), RequestLimits(100, 1000, 1000))
    # min_new_tokens past the room left, max_new_tokens unset (it would become the room): refused, naming it
    assert check_request(ids, SamplingParams(max_new_tokens=None, min_new_tokens=50), LIMITS).max_new_tokens == 50
    with pytest.raises(RequestError, match="min_new_tokens=51 cannot be met: .* at most 50") as e:
        check_request(ids, SamplingParams(max_new_tokens=None, min_new_tokens=51), LIMITS)
    assert e.value.renamed({"min_new_tokens": "min_tokens"}).message.startswith("min_tokens=51 cannot be met")


def test_fit_request_cuts_what_check_request_would_refuse():
    """--allow-auto-truncate: a prompt past the pool (60 here; the context is 100) keeps its first 59 tokens, an
    explicit max_new_tokens past the room left is lowered to it; what fits is left alone."""
    ids = list(range(1, 81))
    cut, params, note = fit_request(ids, SamplingParams(max_new_tokens=30), LIMITS)
    assert cut == ids[:59] and params.max_new_tokens == 1
    assert note == "prompt of 80 tokens cut to its first 59; max_new_tokens 30 lowered to 1"
    assert check_request(cut, params, LIMITS).max_new_tokens == 1
    cut, params, note = fit_request(ids[:10], SamplingParams(max_new_tokens=51), LIMITS)
    assert cut == ids[:10] and params.max_new_tokens == 50 and note == "max_new_tokens 51 lowered to 50"
    p = SamplingParams(max_new_tokens=20)
    assert fit_request(ids[:10], p, LIMITS) == (ids[:10], p, None)
    assert fit_request(ids[:10], SamplingParams(), LIMITS)[2] is None       # the default: check_request lowers it
    with pytest.raises(RequestError, match="token ids must be in"):          # not a length problem: still refused
        check_request(*fit_request([5000] * 70, SamplingParams(), LIMITS)[:2], LIMITS)


def test_finish_reason_json_is_sglangs():
    assert FinishReason("length", length=5).to_json() == {"type": "length", "length": 5}
    assert FinishReason("stop", matched="###").to_json() == {"type": "stop", "matched": "###"}
    assert FinishReason("abort").to_json() == {"type": "abort"}
    assert FinishReason("abort", message="boom", status_code=500).to_json() == {
        "type": "abort", "message": "boom", "status_code": 500}


def test_at_most_one_grammar_and_its_kind():
    assert SamplingParams(regex="a+").grammar == ("regex", "a+")
    assert SamplingParams().grammar is None
    with pytest.raises(ValidationError, match="at most one"):
        SamplingParams(json_schema="{}", ebnf='root ::= "a"')


_OPAQUE_CHECK = """
import sys
import torch
import mlaserve.scheduler.process                  # what every rank imports
from mlaserve.core import compile_opaque, make_compile_opaque
assert "torch._dynamo" not in sys.modules, "a rank's imports pulled in dynamo"
traced = []

@compile_opaque
def launcher(x):
    traced.append(("launcher", torch.compiler.is_compiling()))
    return x * 2 + int(x.sum().item() > 0)

class Block(torch.nn.Module):
    @compile_opaque
    def collective(self, x):
        traced.append(("collective", torch.compiler.is_compiling()))
        return x - 1

    def forward(self, x):
        traced.append(("forward", torch.compiler.is_compiling()))
        return self.collective(launcher(x).sin())

x, block = torch.randn(8), Block()
want = block(x)
make_compile_opaque()
got = torch.compile(block, backend="eager", dynamic=False)(x)
assert torch.equal(got, want)
assert ("forward", True) in traced, traced
assert ("launcher", True) not in traced and ("collective", True) not in traced, traced
print("ok")
"""


def test_compile_opaque_functions_are_not_traced_and_ranks_do_not_import_dynamo():
    """A rank's start skips dynamo's import (over a second per process); once the runners switch it on, torch.compile
    runs the Triton launchers and collectives eagerly between its graphs, functions and methods alike."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OPAQUE_CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
