"""Request fields (native /generate and Engine.generate, OpenAI): one that would act on nothing is a 400 naming it."""
from __future__ import annotations

import pytest

from mlaserve.core import RequestError
from mlaserve.server.engine import engine_inputs

ONE = dict(prompt="hi", sampling_params=None, input_ids=None, return_logprob=False, logprob_start_len=-1,
           top_logprobs_num=0, stream=False, rid=None)


@pytest.mark.parametrize("fields, param, words", [
    (dict(top_logprobs_num=3), "top_logprobs_num", "top_logprobs_num needs return_logprob: true"),
    (dict(logprob_start_len=0), "logprob_start_len", "logprob_start_len needs return_logprob: true"),
    (dict(prompt=["a", "b"], rid="r1"), "rid", "a batch takes a list of rids, one per prompt"),
])
def test_fields_that_would_act_on_nothing_are_refused(fields, param, words):
    with pytest.raises(RequestError) as e:
        engine_inputs(**(ONE | fields))
    assert e.value.param == param and words in e.value.message, e.value.message


def test_the_same_fields_act_where_they_apply():
    (one,), batch = engine_inputs(**(ONE | dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=0,
                                                 rid="r1")))
    assert not batch and (one.top_logprobs_num, one.logprob_start_len, one.rid) == (3, 0, "r1")
    objs, batch = engine_inputs(**(ONE | dict(prompt=["a", "b"])))
    assert batch and [o.rid for o in objs] == [None, None]
    objs, batch = engine_inputs(**(ONE | dict(prompt=["a", "b"], rid=["r1", "r2"])))
    assert batch and [o.rid for o in objs] == ["r1", "r2"]


@pytest.mark.parametrize("model", ["chat", "completions"])
def test_stream_options_need_stream(model):
    from pydantic import ValidationError

    from mlaserve.server.protocol import ChatCompletionRequest, CompletionRequest, describe_errors

    cls, body = ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}) if model == "chat"
                 else (CompletionRequest, {"prompt": "hi"}))
    opts = {"stream_options": {"include_usage": True}}
    assert cls.model_validate(body | opts | {"stream": True}).stream_options.include_usage
    with pytest.raises(ValidationError) as e:
        cls.model_validate(body | opts)
    assert describe_errors(e.value.errors()) == ("Invalid value for 'stream_options': stream_options needs stream: "
                                                 "true", "stream_options")
