"""Structured output in the scheduler (CPU, the random-weight demo model at temperature 1): every constrained
output matches its grammar, with overlap on or off, in batches mixed with free requests, across retraction;
grammar states are freed on finish and abort."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from mlaserve.config import ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.layers.sampler import apply_token_bitmask
import mlaserve.scheduler.grammar as grammar_mod
from mlaserve.scheduler.grammar import grammar_error
from mlaserve.scheduler.scheduler import Scheduler
from mlaserve.tokenizer import load_tokenizer
from seq_runner import drive_scheduler as run

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age"]}
REGEX = r"(yes|no)-[0-9]{2,4}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    import os

    from mlaserve.server.launch import demo_model_path

    os.environ.setdefault("MLASERVE_CACHE", str(tmp_path_factory.mktemp("mlaserve-cache")))
    return str(demo_model_path())


@pytest.fixture(scope="module")
def tok(demo):
    return load_tokenizer(demo)


def make(demo: str, **kw) -> Scheduler:
    args = dict(model_path=demo, device="cpu", dtype="float32", max_total_tokens=4096, log_level="warning")
    return Scheduler(ServerConfig.from_flat(**(args | kw)), demo)


def msg(rid: str, ids: list[int], seed: int, max_new: int = 120, **params) -> GenerateReqMsg:
    return GenerateReqMsg(rid, ids, SamplingParams(max_new_tokens=max_new, seed=seed, **params), seed=seed)


def text_of(tok, res: dict) -> str:
    return tok.decode(res["ids"])


def test_bitmask_masks_every_clear_bit():
    v = 70
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (v + 31) // 32), dtype=torch.int32)
    out = apply_token_bitmask(torch.zeros(3, v), bitmask)
    for b in range(3):
        for t in range(v):
            allowed = (int(bitmask[b, t // 32]) >> (t % 32)) & 1
            assert (out[b, t] == 0) if allowed else (out[b, t] == float("-inf"))


@pytest.mark.parametrize("overlap", [True, False])
def test_constrained_outputs_match_in_a_mixed_batch(demo, tok, overlap):
    sched = make(demo, disable_overlap_schedule=not overlap)
    prompt = tok.encode("Give me JSON:")
    msgs = []
    for i in range(4):
        msgs.append(msg(f"json{i}", prompt, seed=i, json_schema=json.dumps(PERSON)))
        msgs.append(msg(f"re{i}", prompt, seed=i, regex=REGEX))
        msgs.append(msg(f"free{i}", prompt, seed=i, max_new=20))
    out = run(sched, msgs)
    for i in range(4):
        assert out[f"json{i}"]["finished"].kind == "stop"
        jsonschema.validate(json.loads(text_of(tok, out[f"json{i}"])), PERSON)
        assert re.fullmatch(REGEX, text_of(tok, out[f"re{i}"]))
        assert len(out[f"free{i}"]["ids"]) == 20
    assert not sched.grammar.states and not sched.grammar.waiting


def test_free_requests_are_unchanged_by_constrained_neighbours(demo, tok):
    prompt = tok.encode("Hello")
    alone = run(make(demo), [msg("free", prompt, seed=7, max_new=16)])
    mixed = run(make(demo), [msg("free", prompt, seed=7, max_new=16),
                             msg("json", prompt, seed=3, json_schema=json.dumps(PERSON))])
    assert alone["free"]["ids"] == mixed["free"]["ids"]


def test_invalid_grammar_ends_the_request_with_400(demo, tok):
    sched = make(demo)
    out = run(sched, [msg("bad", tok.encode("x"), seed=1, regex="(ab"),
                      msg("ok", tok.encode("x"), seed=1, regex="a{3}")])
    assert out["bad"]["finished"].status_code == 400 and "regex" in out["bad"]["finished"].message
    assert text_of(tok, out["ok"]) == "aaa"
    assert "not closed" in sched.grammar.check("regex", "(ab")
    assert sched.grammar.check("json_schema", json.dumps(PERSON)) is None


def test_without_xgrammar_a_grammar_is_a_400_naming_it(demo, tok, monkeypatch):
    # a machine without xgrammar (the GPU image): each constrained request is refused with one line saying what to
    # install, free requests are served
    assert grammar_mod.xgrammar_installed()                  # this machine has it (a test dependency)
    monkeypatch.setattr(grammar_mod, "xgrammar_installed", lambda: False)
    out = run(make(demo), [msg("re", tok.encode("x"), seed=1, regex="a{3}"),
                           msg("free", tok.encode("x"), seed=1, max_new=4)])
    assert out["re"]["finished"].status_code == 400 and out["re"]["finished"].message == grammar_mod.NO_XGRAMMAR
    assert len(out["free"]["ids"]) == 4


def test_abort_frees_the_grammar_state(demo, tok):
    sched = make(demo)
    out = run(sched, [msg("a", tok.encode("x"), seed=1, json_schema=json.dumps({"type": "string"}), max_new=400)],
              aborts={"a": 3})
    assert out["a"]["finished"].kind == "abort"
    assert not sched.grammar.states and not sched.grammar.waiting


def test_retraction_replays_the_grammar(demo, tok):
    # an optimistic admission estimate in a small pool over-admits, so decode must retract mid-output
    sched = make(demo, max_total_tokens=150, max_running_requests=16, init_new_token_ratio=0.0,
                 min_new_token_ratio=0.0)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 12,
              "maxItems": 12}
    msgs = [msg(f"r{i}", tok.encode("numbers please"), seed=i, json_schema=json.dumps(schema), max_new=60)
            for i in range(10)]
    out = run(sched, msgs)
    big = run(make(demo), msgs)
    assert sched.num_retracted > 0, "the pool was meant to be small enough to force retraction"
    for i in range(10):
        assert out[f"r{i}"]["ids"] == big[f"r{i}"]["ids"]
        jsonschema.validate(json.loads(text_of(tok, out[f"r{i}"])), schema)
    assert not sched.grammar.states


def test_grammar_starts_after_the_start_token(demo, tok):
    """Without `</think>` the output stays free; once it is sampled, only what the regex allows follows. (The trained
    demo model never saw `</think>`: a strong logit bias makes it come.)"""
    end = tok.token_to_id("</think>")

    def sample(bias: float) -> list[int]:
        m = GenerateReqMsg("t", tok.encode("think"), SamplingParams(max_new_tokens=40, seed=5, regex="[0-9]{3}",
                           logit_bias={str(end): bias}), seed=5, grammar_start_id=end)
        return run(make(demo), [m])["t"]["ids"]

    free = sample(0.0)
    assert end not in free and not re.fullmatch("[0-9]{3}", tok.decode(free)), "the grammar applied before </think>"
    ids = sample(40.0)
    assert end in ids
    assert re.fullmatch("[0-9]{3}", tok.decode(ids[ids.index(end) + 1:]))


def test_grammar_error_is_one_line():
    from xgrammar import Grammar

    with pytest.raises(Exception) as info:
        Grammar.from_regex("(ab")
    text = grammar_error(info.value)
    assert "\n" not in text and ".cc" not in text and "not closed" in text


def test_overlap_queues_the_forward_before_processing_the_previous_step(demo, tok, monkeypatch):
    sched = make(demo)
    assert sched.overlap
    calls = []
    for obj, name in ((sched.runner, "launch_forward"), (sched.runner, "launch_sample"), (sched, "drain"),
                      (sched.grammar, "bitmask")):
        inner = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, _f=inner, _n=name, **k: calls.append(_n) or _f(*a, **k))
    run(sched, [msg("j", tok.encode("x"), seed=1, regex="[a-z]{40}")])
    # every constrained step: forward queued, previous step processed (advancing the grammar), bitmask, sampling
    steps = [calls[i:i + 4] for i, c in enumerate(calls) if c == "launch_forward"]
    assert len(steps) >= 6
    assert all(s == ["launch_forward", "drain", "bitmask", "launch_sample"] for s in steps)


def test_a_grammar_that_allows_nothing_is_a_400_not_a_hang(demo, tok):
    out = run(make(demo), [msg("stuck", tok.encode("x"), seed=1, ebnf="root ::= root"),
                           msg("ok", tok.encode("x"), seed=1, ebnf='root ::= "ok"')])
    assert out["stuck"]["finished"].status_code == 400 and "allows no token" in out["stuck"]["finished"].message
    assert text_of(tok, out["ok"]) == "ok"
