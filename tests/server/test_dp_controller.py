"""The data-parallel controller's routing (shortest_queue, round_robin), aborts to the request's group, and the merge
of the groups' answers; real ZeroMQ sockets, no model."""
from __future__ import annotations

import random

import pytest
import zmq.asyncio

from mlaserve.core import FinishReason, SamplingParams
from mlaserve.ipc import messages as m
from mlaserve.server.dp_controller import DataParallelController, dp_addresses, merge_stats
from mlaserve.server.metrics import ServerMetrics


@pytest.fixture
def controller(tmp_path):
    ctx = zmq.asyncio.Context()
    made = []

    def make(method: str, groups: int = 2) -> DataParallelController:
        made.append(DataParallelController(ctx, dp_addresses(f"ipc://{tmp_path}/req", groups), method))
        return made[-1]
    yield make
    ctx.destroy(linger=0)


def req(rid: str, n: int) -> m.GenerateReqMsg:
    return m.GenerateReqMsg(rid, list(range(5, 5 + n)), SamplingParams(max_new_tokens=8), seed=1)


def group(c: DataParallelController, msg: object) -> list[int]:
    return [c.sockets.index(s) for s in c.targets(msg)]


def test_shortest_queue_sends_each_request_to_the_group_with_the_fewest_tokens(controller):
    c = controller("shortest_queue")
    assert group(c, req("long", 100)) == [0]
    assert group(c, req("a", 10)) == [1]
    assert group(c, req("b", 10)) == [1]          # 20 tokens there against 100
    c.on_output(m.ReqOutput(rid="a", new_ids=[7] * 85, finished=None))
    assert c.load == [100, 105] and group(c, req("c", 1)) == [0]
    c.on_output(m.ReqOutput(rid="long", new_ids=[], finished=FinishReason("length", length=8)))
    assert c.load == [1, 105] and group(c, req("d", 1)) == [0]


def test_round_robin_takes_the_groups_in_turn(controller):
    rng = random.Random(seed := random.randrange(2**31))
    print(f"seed {seed}")
    c = controller("round_robin", groups=3)
    assert [group(c, req(f"r{i}", rng.randint(1, 500)))[0] for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_aborts_reach_the_requests_group_and_control_messages_every_group(controller):
    c = controller("round_robin")
    group(c, req("x", 3))
    group(c, req("y", 3))
    assert group(c, m.AbortReqMsg("y")) == [1] and group(c, m.AbortReqMsg("x")) == [0]
    c.forget("y")                                  # its caller went away: an abort of it now reaches every group
    assert group(c, m.AbortReqMsg("y")) == [0, 1]
    assert group(c, m.GetStatsReqMsg()) == [0, 1] and group(c, m.FlushCacheReqMsg()) == [0, 1]
    assert c.replies_expected(m.GetStatsReqMsg()) == 2


def test_merged_stats_keep_each_group_and_metrics_label_them():
    g0 = {"dp_rank": 0, "num_running_reqs": 3, "used_tokens": 100, "max_total_tokens": 1000, "token_usage": 0.1,
          "prompt_tokens": 40, "cached_tokens": 10}
    g1 = {"dp_rank": 1, "num_running_reqs": 0, "used_tokens": 0, "max_total_tokens": 1000, "token_usage": 0.0,
          "prompt_tokens": 0, "cached_tokens": 0}
    merged = merge_stats([g1, g0])
    assert (merged["num_running_reqs"], merged["max_total_tokens"], merged["token_usage"]) == (3, 2000, 0.05)
    assert [g["dp_rank"] for g in merged["dp_groups"]] == [0, 1] and "dp_rank" not in merged
    assert DataParallelController.merge([m.FlushCacheRespMsg(True), m.FlushCacheRespMsg(False)]).ok is False
    metrics = ServerMetrics()
    metrics.update(merged)
    text = metrics.render().decode()
    assert 'mlaserve:num_running_reqs{dp_rank="0"} 3.0' in text and 'mlaserve:num_running_reqs{dp_rank="1"} 0.0' in text
    assert 'mlaserve:cache_hit_rate{dp_rank="0"} 0.2' in text
