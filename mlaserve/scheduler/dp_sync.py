"""The per-step agreement of data-parallel attention: before every forward all ranks exchange [tokens, mode] of
the batch their group planned, so each knows whether anyone has work and every group's token count (the MoE
gather's layout). A group with nothing planned while another has work runs an IDLE batch, so the collectives of
all ranks line up; when no group has work, no rank runs a forward.
"""
from __future__ import annotations

import torch

from mlaserve.core import Batch, ForwardMode
from mlaserve.distributed import RankGroup

MODE_CODES = {None: 0, ForwardMode.EXTEND: 1, ForwardMode.DECODE: 2, ForwardMode.IDLE: 3}
MODES = {code: mode for mode, code in MODE_CODES.items()}


def idle_batch() -> Batch:
    return Batch(ForwardMode.IDLE, [], [], torch.empty(0, dtype=torch.int64), [], [], [])


class DPStepSync:
    """Owned by each rank's scheduler under DP attention; `agree` is collective (one per loop iteration, every rank).

    `busy` says whether any group had work at the last agreement (an idle leader then does not wait for messages,
    which would hold up the groups that decode). `slots(batch)` gives the token counts of the step's forwards in
    order: one forward without speculative decoding; under it S draft forwards, the target's and the draft
    layer's twice (a mixed batch's decodes repair after its prompts' draft-layer extend: `engine/spec.slot_counts`),
    so that every group runs every forward that any group runs.

    `graph_sizes` (the captured decode graph sizes, None without graphs): when every group decodes or has nothing,
    and the largest group's batch fits a graph, every rank replays the graph of the smallest captured size that
    holds it (`Batch.graph_bs`); a prefill anywhere makes the step eager on every rank.

    `piece_sizes` (the captured piecewise extend token counts, None without them): when every group extends (a
    mixed batch too) or has nothing, and the largest group's model forward (forward `extend_slot` of the step: the
    target's under speculative decoding) fits them, every rank runs the pieces of the smallest captured count that
    holds it (`Batch.piece_tokens`; a group with nothing runs them on padding rows); a decode anywhere makes the
    step eager on every rank."""

    def __init__(self, group: RankGroup, slots=None, graph_sizes: list[int] | None = None,
                 piece_sizes: list[int] | None = None, extend_slot: int = 0):
        self.group, self.busy = group, False
        self.graph_sizes = sorted(graph_sizes) if graph_sizes else None
        self.piece_sizes = sorted(piece_sizes) if piece_sizes else None
        self.extend_slot = extend_slot
        self.slots = slots or (lambda batch: [sum(batch.extend_lens)])
        self.modes: list[ForwardMode | None] = []      # each group's mode at the last agreement (None: nothing)

    def agree(self, batch: Batch | None) -> Batch | None:
        """`batch` with `global_num_tokens` set, an IDLE batch when only other groups have work, or None."""
        info = self.group.info
        # NOTE: a decode batch reads its input ids on the device (batch.input_ids is empty): count extend_lens
        counts = self.slots(batch) if batch is not None else None
        assert batch is None or sum(counts) > 0, "a planned batch has tokens"
        mine = [MODE_CODES[batch.mode]] + counts if batch is not None else [0] + [0] * len(self.slots(idle_batch()))
        rows = self.group.all_gather_ints(mine)[:: info.attn_tp_size]     # one rank per DP group
        codes = {c: m for m, c in MODE_CODES.items()}
        self.modes = [codes[r[0]] for r in rows]
        per_slot = [[r[1 + i] for r in rows] for i in range(len(mine) - 1)]   # [slot][group]
        self.busy = any(any(c) for c in per_slot)
        if not self.busy:
            return None
        if batch is None:
            batch = idle_batch()
        batch.slot_tokens = per_slot
        batch.global_num_tokens = per_slot[0] if len(per_slot) == 1 else None
        batch.graph_bs = self._graph_size(per_slot)
        batch.piece_tokens = self._piece_size(per_slot)
        return batch

    def _graph_size(self, per_slot: list[list[int]]) -> int | None:
        # NOTE: a decode's first forward has one token per request, speculative or not (its first draft step)
        if self.graph_sizes is None:
            return None
        if not set(self.modes) <= {ForwardMode.DECODE, None} or max(per_slot[0]) > self.graph_sizes[-1]:
            return None
        return next(s for s in self.graph_sizes if s >= max(per_slot[0]))

    def _piece_size(self, per_slot: list[list[int]]) -> int | None:
        if self.piece_sizes is None or not set(self.modes) <= {ForwardMode.EXTEND, None}:
            return None
        most = max(per_slot[self.extend_slot])
        return next((s for s in self.piece_sizes if s >= most), None)
