"""The scheduler's batch lines at info level (SGLang's prefill / decode batch logs, in our words): one per prefill
batch, one every --decode-log-interval decode steps with the generation rate since the last line."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from mlaserve.core import Batch, ForwardMode

if TYPE_CHECKING:
    from mlaserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class BatchLog:
    """Decode steps so far and the (generated tokens, time) mark the next decode line's rate counts from; an idle
    spell clears the mark, so the rate is over working time (tokens are counted as processed: overlap lags a step)."""

    def __init__(self, interval: int, on: bool):
        self.interval, self.on = interval, on and logger.isEnabledFor(logging.INFO)
        self.decode_steps, self.mark = 0, None

    def reset(self) -> None:
        self.decode_steps, self.mark = 0, None

    def idle(self) -> None:
        self.mark = None

    def batch(self, batch: Batch, sched: Scheduler) -> None:
        if not self.on:
            return
        queued = sched.num_queued
        usage = sched.kv.used() / sched.kv.num_slots
        if batch.mode is ForwardMode.EXTEND:
            n = batch.size - batch.num_decode
            logger.info("prefill batch: %d requests, %d new tokens, %d tokens from the cache or earlier chunks, "
                        "%d decoding alongside; KV usage %.2f, %d running, %d queued", n,
                        sum(batch.extend_lens[:n]), sum(batch.prefix_lens[:n]), batch.num_decode, usage,
                        len(sched.running), queued)
            return
        made, now = sched.stats["generation_tokens"], time.monotonic()
        if self.mark is None:
            self.mark = (made, now)
        self.decode_steps += 1
        if self.decode_steps % self.interval:
            return
        rate = (made - self.mark[0]) / max(now - self.mark[1], 1e-9)
        self.mark = (made, now)
        logger.info("decode batch: %d running, %d KV tokens, KV usage %.2f, generation %.1f tok/s, %d queued",
                    batch.size, sched.kv.used(), usage, rate, queued)
