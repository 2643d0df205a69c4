"""The tokenizer manager against a scripted scheduler on real ZeroMQ sockets: seeds from --seed, one request's
failure stays its own, and a dead scheduler or receive loop fails every request at once (never a hang)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from mlaserve.core import FinishReason, SamplingParams
from mlaserve.ipc import messages as m
from mlaserve.server.manager import EngineDeadError, GenerateInput, RequestError, TokenizerManager

INFO = {"context_length": 256, "max_total_tokens": 512, "vocab_size": 4096}
WAIT_S = 10.0     # far above what any step here takes: reaching it means a hang


class FakeScheduler:
    """The scheduler's end of the two sockets: reads requests, sends whatever the test scripts."""

    def __init__(self, send_addr: str, recv_addr: str):
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(send_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(recv_addr)

    async def request(self) -> object:
        return m.decode(await asyncio.wait_for(self.inbox.recv(), WAIT_S))

    async def send(self, *outputs: m.ReqOutput) -> None:
        await self.outbox.send(m.encode(m.BatchOutMsg(list(outputs))))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def make(tokenizer, tmp_path: Path, seed: int = 0, alive=None) -> tuple[TokenizerManager, FakeScheduler]:
    base = f"ipc://{tmp_path}/mgr-{seed}-{id(alive)}"
    manager = TokenizerManager(tokenizer, base + "-req", base + "-out", INFO, seed=seed, alive=alive)
    return manager, FakeScheduler(base + "-req", base + "-out")


@contextlib.asynccontextmanager
async def started(tokenizer, tmp_path: Path) -> AsyncIterator[tuple[TokenizerManager, FakeScheduler]]:
    """A started manager and its scripted scheduler, both closed on the way out."""
    manager, fake = make(tokenizer, tmp_path)
    manager.start()
    try:
        yield manager, fake
    finally:
        await manager.aclose()
        fake.close()


async def running(manager: TokenizerManager, fake: FakeScheduler, rid: str | None, text: str = "a",
                  **fields) -> tuple[asyncio.Future, str]:
    """A request under way (its final snapshot, a future) and the id the scheduler knows it by."""
    fut = asyncio.ensure_future(final(manager, manager.prepare(GenerateInput(text=text, rid=rid, **fields))))
    return fut, (await fake.request()).rid


async def final(manager: TokenizerManager, req: m.GenerateReqMsg) -> dict:
    last = None
    async for last in manager.generate(req):
        pass
    return last


def test_seeds_come_from_the_seed_flag(demo_tokenizer, tmp_path):
    def seeds(seed: int) -> list[int]:
        manager, fake = make(demo_tokenizer, tmp_path, seed)
        try:
            objs = [GenerateInput(text="hi"), GenerateInput(input_ids=[1, 2]), GenerateInput(text="x")]
            return [manager.prepare(o).seed for o in objs]
        finally:
            fake.close()
            manager.ctx.destroy(linger=0)

    assert seeds(7) == seeds(7) != seeds(8)
    manager, fake = make(demo_tokenizer, tmp_path, 9)
    assert manager.prepare(GenerateInput(text="hi", sampling_params=SamplingParams(seed=-5))).seed == -5
    fake.close()
    manager.ctx.destroy(linger=0)


def test_allow_auto_truncate_cuts_before_the_check(demo_tokenizer, tmp_path, caplog):
    """With the scheduler's allow_auto_truncate in its info, prepare cuts a prompt longer than the context to its
    first tokens and lowers a max_new_tokens that cannot fit (one warning each); without it, both are a 400."""
    ids, many = list(range(5, 400)), SamplingParams(max_new_tokens=1000)
    manager, fake = make(demo_tokenizer, tmp_path)
    try:
        for obj, param in ((GenerateInput(input_ids=ids), "input_ids"),
                           (GenerateInput(input_ids=ids[:6], sampling_params=many), "max_new_tokens")):
            with pytest.raises(RequestError) as e:
                manager.prepare(obj)
            assert e.value.param == param and e.value.status_code == 400
        manager.info = {**INFO, "allow_auto_truncate": True}
        req = manager.prepare(GenerateInput(input_ids=ids, rid="long"))
        assert req.input_ids == ids[:255] and req.params.max_new_tokens == 1        # context 256
        assert manager.prepare(GenerateInput(input_ids=ids[:6], sampling_params=many)).params.max_new_tokens == 250
        assert "request long: prompt of 395 tokens cut to its first 255" in caplog.text
    finally:
        fake.close()
        manager.ctx.destroy(linger=0)


def test_a_failing_output_ends_only_its_request(demo_tokenizer, tmp_path):
    async def go():
        manager, fake = make(demo_tokenizer, tmp_path)
        manager.start()
        try:
            bad = manager.prepare(GenerateInput(text="a", rid="bad"))
            good = manager.prepare(GenerateInput(text="b", rid="good"))
            tasks = [asyncio.ensure_future(final(manager, r)) for r in (bad, good)]
            sent = {tuple(r.input_ids): r.rid for r in [await fake.request() for _ in range(2)]}
            b, g = sent[tuple(bad.input_ids)], sent[tuple(good.input_ids)]    # the scheduler's ids of the two runs
            # the detokenizer cannot decode a negative id: only "bad" fails; its abort reaches the scheduler
            await fake.send(m.ReqOutput(b, [-5]), m.ReqOutput(g, [300, 301]))
            await fake.send(m.ReqOutput(g, [302], finished=FinishReason("length", length=3)))
            out_bad, out_good = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
            assert isinstance(await fake.request(), m.AbortReqMsg)
            return out_bad["meta_info"]["finish_reason"], out_good
        finally:
            await manager.aclose()
            fake.close()

    reason, good = asyncio.run(go())
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "OverflowError" in reason["message"]
    assert good["output_ids"] == [300, 301, 302] and good["meta_info"]["finish_reason"] == {"type": "length",
                                                                                              "length": 3}


@pytest.mark.parametrize("how", ["garbage", "scheduler_dead"])
def test_dead_loop_or_scheduler_fails_pending_and_later_requests(demo_tokenizer, tmp_path, how):
    alive = [True]

    async def go():
        manager, fake = make(demo_tokenizer, tmp_path, alive=lambda: alive[0])
        manager.start()
        try:
            pending = asyncio.ensure_future(final(manager, manager.prepare(GenerateInput(text="a"))))
            await fake.request()
            if how == "garbage":
                await fake.outbox.send(b"not a pickle")
            else:
                alive[0] = False
            with pytest.raises(EngineDeadError) as e:
                await asyncio.wait_for(pending, WAIT_S)
            with pytest.raises(EngineDeadError):
                manager.prepare(GenerateInput(text="b"))
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(manager.flush_cache(), WAIT_S)
            return str(e.value), manager.dead
        finally:
            await manager.aclose()
            fake.close()

    message, dead = asyncio.run(go())
    assert message == dead
    assert ("receive loop failed" in dead) if how == "garbage" else ("scheduler process is not running" in dead)


def test_grammar_checks_round_trip_once_per_grammar(demo_tokenizer, tmp_path):
    async def go():
        manager, fake = make(demo_tokenizer, tmp_path, 11)
        manager.start()
        try:
            bad = manager.prepare(GenerateInput(text="x", sampling_params=SamplingParams(regex="(ab")))
            again = manager.prepare(GenerateInput(text="y", sampling_params=SamplingParams(regex="(ab")))
            checking = asyncio.ensure_future(manager.check_grammars([bad]))
            msg = await fake.request()
            assert isinstance(msg, m.GrammarCheckReqMsg) and (msg.kind, msg.text) == ("regex", "(ab")
            await fake.outbox.send(m.encode(m.GrammarCheckRespMsg(msg.key, "the parenthesis is not closed")))
            for call in (checking, manager.check_grammars([again])):     # the second answer comes from the cache
                with pytest.raises(RequestError) as info:
                    await asyncio.wait_for(call, WAIT_S)
                assert info.value.param == "sampling_params.regex" and "not closed" in info.value.message
            free = manager.prepare(GenerateInput(text="z"))
            await asyncio.wait_for(manager.check_grammars([free]), WAIT_S)      # nothing to check, nothing sent
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(fake.inbox.recv(), 0.3)
        finally:
            fake.close()
            await manager.aclose()

    asyncio.run(go())


def test_grammar_backend_none_refuses_constrained_requests(demo_tokenizer, tmp_path):
    base = f"ipc://{tmp_path}/mgr-none"
    manager = TokenizerManager(demo_tokenizer, base + "-req", base + "-out", INFO | {"grammar_backend": "none"})
    try:
        with pytest.raises(RequestError) as info:
            manager.prepare(GenerateInput(text="x", sampling_params=SamplingParams(json_schema='{"type": "string"}')))
        assert info.value.param == "sampling_params.json_schema" and "--grammar-backend none" in info.value.message
        assert manager.prepare(GenerateInput(text="x")).params.grammar is None
    finally:
        manager.ctx.destroy(linger=0)


def test_a_reused_rid_never_gets_the_previous_runs_outputs(demo_tokenizer, tmp_path):
    """A caller that reuses its rid at once (after a disconnect, or after a stop string ended the last run) is not
    ended by the previous run's abort answer still in flight: each run has its own id at the scheduler."""
    async def go():
        async with started(demo_tokenizer, tmp_path) as (manager, fake):
            first = manager.generate(manager.prepare(GenerateInput(text="a", rid="R", stream=True)))
            pending = asyncio.ensure_future(first.__anext__())
            old = (await fake.request()).rid
            await fake.send(m.ReqOutput(old, [300]))
            await asyncio.wait_for(pending, WAIT_S)
            await first.aclose()                           # the caller went away
            abort = await fake.request()
            assert isinstance(abort, m.AbortReqMsg) and abort.rid == old
            again, new = await running(manager, fake, "R")
            assert new != old
            await fake.send(m.ReqOutput(old, [], finished=FinishReason("abort")))     # the old run's answer
            await fake.send(m.ReqOutput(new, [301, 302], finished=FinishReason("length", length=2)))
            return await asyncio.wait_for(again, WAIT_S)

    out = asyncio.run(go())
    assert out["output_ids"] == [301, 302] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert out["meta_info"]["id"] == "R"


def test_a_rid_in_flight_is_refused(demo_tokenizer, tmp_path):
    async def go():
        async with started(demo_tokenizer, tmp_path) as (manager, fake):
            first, wire = await running(manager, fake, "R")
            with pytest.raises(RequestError) as e:
                await final(manager, manager.prepare(GenerateInput(text="b", rid="R")))
            await fake.send(m.ReqOutput(wire, [301], finished=FinishReason("length", length=1)))
            return e.value, await asyncio.wait_for(first, WAIT_S)

    err, out = asyncio.run(go())
    assert err.param == "rid" and "already running" in err.message
    assert out["output_ids"] == [301] and out["meta_info"]["id"] == "R"


def test_abort_request_ends_the_callers_request_and_frees_it_at_the_scheduler(demo_tokenizer, tmp_path):
    """/abort_request by the caller's rid: the caller gets its tokens so far with an abort finish at once, the
    scheduler is told the run's own id; an unknown rid aborts nothing; abort_all ends every running request."""
    async def go():
        async with started(demo_tokenizer, tmp_path) as (manager, fake):
            first, wire = await running(manager, fake, "R")
            await fake.send(m.ReqOutput(wire, [300]))
            while not manager.states[wire].ids:
                await asyncio.sleep(0.01)
            none = await manager.abort_request("other")
            one = await manager.abort_request("R")
            told = await fake.request()
            out = await asyncio.wait_for(first, WAIT_S)
            others = [await running(manager, fake, r, "b") for r in ("S", "T")]
            both = await manager.abort_request(None, abort_all=True)
            told_all = {(await fake.request()).rid for _ in others}
            outs = await asyncio.wait_for(asyncio.gather(*(f for f, _ in others)), WAIT_S)
            return none, one, told, wire, out, both, told_all == {w for _, w in others}, outs

    none, one, told, wire, out, both, all_told, outs = asyncio.run(go())
    assert (none, one, both) == (0, 1, 2) and all_told
    assert isinstance(told, m.AbortReqMsg) and told.rid == wire
    assert out["output_ids"] == [300] and out["meta_info"]["id"] == "R"
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by an /abort_request call"}
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)


@pytest.mark.parametrize("keep", [False, True])
def test_the_matched_stop_token_is_not_in_the_text(demo_tokenizer, tmp_path, keep):
    """As SGLang: a request ended by one of its stop_token_ids (or EOS) has that token in output_ids but not in its
    text, unless no_stop_trim."""
    async def go():
        async with started(demo_tokenizer, tmp_path) as (manager, fake):
            params = SamplingParams(stop_token_ids=[302], no_stop_trim=keep)
            run, wire = await running(manager, fake, None, sampling_params=params)
            await fake.send(m.ReqOutput(wire, [300, 301]))
            await fake.send(m.ReqOutput(wire, [302], finished=FinishReason("stop", matched=302)))
            return await asyncio.wait_for(run, WAIT_S)

    out = asyncio.run(go())
    assert out["output_ids"] == [300, 301, 302] and out["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                            "matched": 302}
    assert out["text"] == demo_tokenizer.decode([300, 301, 302] if keep else [300, 301])
