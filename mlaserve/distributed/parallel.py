"""Ranks and process groups of one server, and the collectives the model and the scheduler call.

One process per rank. `ParallelInfo` says where a process sits (built once from the resolved config and its
rank); `init_distributed` joins the ranks over torch.distributed: NCCL for tensors on GPUs, gloo on the CPU,
and always a gloo group for host objects (the scheduler's step messages). Layers receive a `TensorParallel`
(their shard index, the group size and the two collectives they need), never a global getter.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mlaserve.core import compile_opaque
from mlaserve.env import install_stack_dumps

if TYPE_CHECKING:
    from mlaserve.distributed.dp_attention import DPAttention
    from mlaserve.distributed.peer import PeerAllReduce
    from mlaserve.kernels.allreduce import LLGroup

logger = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective with the other ranks failed or timed out (a rank died, hung or never joined)."""


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place among the server's ranks (tensor parallel over every rank, spread over nodes).

    Ranks are numbered node by node: node n runs ranks n * local_size .. (n + 1) * local_size - 1. Under
    data-parallel attention (`dp_size` > 1) rank r is in DP group r // attn_tp_size, as its attn_tp_rank:

        ranks   | 0 .. a-1 | a .. 2a-1 | ... |    a = attn_tp_size = tp_size / dp_size
        dp_rank |    0     |     1     | ... |    each group: its own scheduler, KV pool, radix tree
    """

    tp_size: int = 1
    rank: int = 0
    nnodes: int = 1
    dp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def local_size(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.attn_tp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.rank % self.attn_tp_size

    @property
    def leader_rank(self) -> int:
        """The first rank of this rank's DP group (rank 0 without DP attention)."""
        return self.dp_rank * self.attn_tp_size

    @property
    def is_leader(self) -> bool:
        """The first rank of each DP group (rank 0 without DP attention) reads the group's requests and sends its
        outputs; the group's other ranks follow its step messages."""
        return self.attn_tp_rank == 0


class TensorParallel:
    """What a layer needs of tensor parallelism: its shard index, the group size, all-reduce and all-gather.

    `TensorParallel()` is the single-process group (size 1: every collective is the identity).
    """

    def __init__(self, rank: int = 0, size: int = 1, group: "dist.ProcessGroup | None" = None,
                 nccl: bool = False):
        self.rank, self.size, self.group, self.nccl = rank, size, group, nccl
        self.peer: PeerAllReduce | None = None     # the one-shot all-reduce over peer buffers, where it runs

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}{', peer' if self.peer else ''})"

    def split(self, n: int, what: str) -> int:
        """n / size, the local share of a dimension of n (ValueError naming `what` when it does not divide)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) cannot be split across --tp-size {self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (the partial outputs of row-parallel layers): one launch over the
        peer buffers when they take x, else NCCL (gloo on the CPU)."""
        if self.fuses_norm(x):
            self.peer.all_reduce(x)
        elif self.size > 1:
            _all_reduce(x, self.group)
        return x

    def fuses_norm(self, x: torch.Tensor) -> bool:
        """Whether x goes over the peer buffers, so that `all_reduce_add_norm` runs it as one launch (else the
        caller reduces and norms apart)."""
        return self.size > 1 and self.peer is not None and self.peer.fits(x)

    def push_group(self, x: torch.Tensor) -> "LLGroup | None":
        """The push all-reduce's buffers where a call on x would take it (`PeerAllReduce.pushes`): a kernel
        producing x may then sum it over the ranks itself (`fused_moe_norm`'s all_reduce), unless
        MLASERVE_KERNEL_SUMS=0 (`peer.kernel_sums`). Same on every rank."""
        if self.fuses_norm(x) and self.peer.kernel_sums and self.peer.pushes(x):
            return self.peer.ll_group
        return None

    def all_reduce_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(sum + residual) * weight, sum + residual) with the sum of x over the ranks, in one launch; the
        new residual is `residual` updated in place (or, a row split over programs, a new tensor: use the one
        returned). Only where `fuses_norm(x)`."""
        return self.peer.all_reduce_add_norm(x, residual, weight, eps)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's part at columns r * n .. (r + 1) * n - 1."""
        if self.size == 1:
            return x
        return _all_gather_last(x, self.size, self.group, self.nccl)


@compile_opaque
def _all_reduce(x: torch.Tensor, group) -> None:
    dist.all_reduce(x, group=group)


@compile_opaque
def _all_gather_last(x: torch.Tensor, size: int, group, nccl: bool) -> torch.Tensor:
    x = x.contiguous()
    if nccl:
        out = torch.empty((size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)         # [size, ..., n]
        parts = out.unbind(0)
    else:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class RankGroup:
    """The joined ranks of one server: the tensor-parallel group the model uses, and host-side collectives
    over a gloo group (step messages, agreeing on sizes) for the scheduler. Every call is collective.

    Under data-parallel attention `tp` is this rank's attention group (tp_size / dp_size ranks), `dp` the
    gather / scatter around the MoE over all ranks, and `leader_cpu_group` the gloo group of this DP group."""

    def __init__(self, info: ParallelInfo, tp: TensorParallel, cpu_group: "dist.ProcessGroup | None",
                 dp: "DPAttention | None" = None, leader_cpu_group: "dist.ProcessGroup | None" = None):
        self.info, self.tp, self.cpu_group, self.dp = info, tp, cpu_group, dp
        self.leader_cpu_group = leader_cpu_group if dp is not None else cpu_group

    @property
    def size(self) -> int:
        return self.info.world_size

    def broadcast(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (the others pass None)."""
        if self.size == 1:
            return obj
        box = [obj]
        self._guard(dist.broadcast_object_list, box, src=0, group=self.cpu_group)
        return box[0]

    def broadcast_from_leader(self, obj: object) -> object:
        """The DP group leader's `obj` on every rank of its group (all ranks without DP attention)."""
        if self.info.attn_tp_size == 1:
            return obj
        box = [obj]
        self._guard(dist.broadcast_object_list, box, src=self.info.leader_rank, group=self.leader_cpu_group)
        return box[0]

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (the same length on every rank), in rank order: one small gloo all-gather."""
        if self.size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self._guard(dist.all_gather, out, mine, group=self.cpu_group)
        return [t.tolist() for t in out]

    def min_int(self, value: int) -> int:
        """The minimum of `value` over the ranks (e.g. the KV-pool size every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._guard(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[object] = [None] * self.size
        self._guard(dist.all_gather_object, out, obj, group=self.cpu_group)
        return out

    def _guard(self, fn, *args, **kw) -> None:
        try:
            fn(*args, **kw)
        except (RuntimeError, ValueError, OSError) as e:     # gloo / NCCL report a lost peer as RuntimeError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CollectiveError(f"rank {self.info.rank}: a collective with the other ranks failed (a rank died "
                                  f"or stopped responding): {first}") from None


def init_distributed(info: ParallelInfo, init_addr: str, timeout_s: float | None,
                     device: torch.device, peer_all_reduce: bool | None = None) -> RankGroup:
    """Join the server's ranks at `init_addr` (host:port of rank 0's store). Single-rank servers create no
    process group. Raises CollectiveError (one line) when the ranks cannot meet.

    `peer_all_reduce`: the tensor-parallel group's small all-reduces over peer buffers: None = where it can run
    (GPUs of one host with peer access), False = never (`--disable-custom-all-reduce`), True = always, CPU ranks
    included (the Triton interpreter: tests), ValueError where it cannot."""
    if info.world_size == 1:
        return RankGroup(info, TensorParallel(), None)
    if info.tp_size % info.dp_size:
        raise ValueError(f"--tp-size {info.tp_size} is not a multiple of --dp-size {info.dp_size}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    kw = {"timeout": timeout} if timeout is not None else {}
    try:
        dist.init_process_group(backend, init_method=f"tcp://{init_addr}", world_size=info.world_size,
                                rank=info.rank, **kw)
        cpu_group = dist.new_group(backend="gloo", **kw) if backend == "nccl" else dist.group.WORLD
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CollectiveError(f"cannot join the other ranks at --dist-init-addr {init_addr}: {first}") from None
    world = TensorParallel(info.tp_rank, info.tp_size, dist.group.WORLD, nccl=backend == "nccl")
    if info.dp_size > 1:
        group = _dp_attention_group(info, world, cpu_group, backend, kw)
    else:
        group = RankGroup(info, world, cpu_group)
    if backend == "nccl":
        # NOTE: the NCCL communicators are created by the first collective; do it now, before any graph capture
        world.all_reduce(torch.zeros(1, device=device))
        group.tp.all_reduce(torch.zeros(1, device=device))
    if peer_all_reduce is not False:
        _attach_peer(info, group.tp, cpu_group, device, required=bool(peer_all_reduce))
        if group.dp is not None:            # the MoE's all-reduce over every rank (DP attention, decode sizes)
            _attach_peer(info, group.dp.world, cpu_group, device, required=bool(peer_all_reduce), what="MoE")
    logger.info("rank %d of %d joined (%s, node %d of %d)", info.rank, info.world_size, backend, info.node_rank,
                info.nnodes)
    return group


def _dp_attention_group(info: ParallelInfo, world: TensorParallel, cpu_group, backend: str, kw: dict) -> RankGroup:
    """The attention groups (tp_size / dp_size consecutive ranks each) over the joined world."""
    from mlaserve.distributed.dp_attention import DPAttention

    a = info.attn_tp_size
    attn, attn_cpu = TensorParallel(), None
    if a > 1:
        for d in range(info.dp_size):          # NOTE: every rank creates every group, in the same order
            ranks = list(range(d * a, (d + 1) * a))
            g = dist.new_group(ranks, backend=backend, **kw)
            g_cpu = dist.new_group(ranks, backend="gloo", **kw) if backend == "nccl" else g
            if d == info.dp_rank:
                attn, attn_cpu = TensorParallel(info.attn_tp_rank, a, g, nccl=backend == "nccl"), g_cpu
    dp = DPAttention(info.dp_rank, info.dp_size, a, world)
    return RankGroup(info, attn, cpu_group, dp=dp, leader_cpu_group=attn_cpu)


def _attach_peer(info: ParallelInfo, tp: TensorParallel, cpu_group, device: torch.device, required: bool,
                 what: str = "tensor-parallel") -> None:
    """Give `tp` its peer all-reduce when every group of the world can have one (collective over the world)."""
    from mlaserve.distributed.peer import PeerAllReduce, peer_members, why_not_peer

    if tp.size == 1:
        return
    members = peer_members(info.rank, tp.rank, tp.size)
    dev = torch.cuda.current_device() if device.type == "cuda" else -1
    devices: list = [None] * info.world_size
    dist.all_gather_object(devices, dev, group=cpu_group)
    why = why_not_peer(device, members, info.local_size, [devices[m] for m in members], cpu=required)
    whys: list = [None] * info.world_size
    dist.all_gather_object(whys, why, group=cpu_group)
    why = next((f"rank {r}: {w}" for r, w in enumerate(whys) if w), None)
    if why is not None:
        if required:
            raise ValueError(f"the peer all-reduce cannot run: {why}")
        if device.type == "cuda" and info.rank == 0:
            logger.info("small %s all-reduces run on NCCL (no peer buffers: %s)", what, why)
        return
    tp.peer = PeerAllReduce(tp.rank, members, cpu_group, device)
    if info.rank == 0:
        logger.info("small %s all-reduces (<= %d rows) run over peer buffers in one launch", what,
                    tp.peer.peers.max_rows)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_ranks(fn, world: int, *args, device: str = "cpu", timeout: float = 3600.0, dp_size: int = 1,
                peer_all_reduce: bool | None = None) -> list:
    """fn(group, *args) on `world` freshly spawned ranks joined on a free loopback port (rank r on `cuda:r` when
    `device` is "cuda"; `dp_size` DP-attention groups; `peer_all_reduce` as
    `init_distributed` takes it); returns each rank's result in rank order. `fn` must be importable by name."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, daemon=True,
                           args=(fn, rank, world, addr, device, args, send, dp_size, peer_all_reduce))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    try:
        results = []
        for rank, recv in enumerate(pipes):
            if not recv.poll(timeout):
                raise CollectiveError(f"rank {rank} gave no result in {timeout:.0f} s")
            status, value = pickle.loads(recv.recv_bytes())
            if status != "ok":
                raise CollectiveError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def _rank_main(fn, rank: int, world: int, addr: str, device: str, args: tuple, conn, dp_size: int = 1,
               peer_all_reduce: bool | None = None) -> None:
    import traceback

    install_stack_dumps()
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    # NOTE: plain pickle, by value: multiprocessing's own pickler would send tensors as shared-memory handles that
    # the caller can no longer open once this rank has exited
    try:
        group = init_distributed(ParallelInfo(world, rank, dp_size=dp_size), addr, 600, dev, peer_all_reduce)
        conn.send_bytes(pickle.dumps(("ok", fn(group, *args))))
    except BaseException:  # noqa: BLE001 - reported to the caller
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        shutdown_distributed()
