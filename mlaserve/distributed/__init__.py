"""Ranks, process groups and the collectives the model and the scheduler call (DESIGN.md sec. 6)."""
from mlaserve.distributed.parallel import (CollectiveError, ParallelInfo, RankGroup, TensorParallel,
                                           init_distributed, shutdown_distributed, spawn_ranks)
from mlaserve.distributed.dp_attention import DPAttention

__all__ = ["CollectiveError", "DPAttention", "ParallelInfo", "RankGroup", "TensorParallel", "init_distributed",
           "shutdown_distributed", "spawn_ranks"]
