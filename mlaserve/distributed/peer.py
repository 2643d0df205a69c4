"""The fast small all-reduce of the decode path: every rank of a tensor-parallel group maps the others' staging
buffers and signal pads, and one Triton launch sums a batch of rows (`kernels/allreduce.py`).

GPUs of one host share memory through CUDA IPC: the buffers are allocated with the driver API (`libcuda`, through
ctypes) and each rank opens the others' handles in its own device's context, with peer access enabled lazily (no
context on the other GPUs, whose memory that would cost); the handles are exchanged once over the host (gloo)
group. CPU ranks share POSIX shared memory, and the kernel runs under the Triton interpreter: that is how CI
tests the protocol with two processes. NCCL stays the path for
anything larger than the buffers, for groups that span nodes or lack peer access, and is the reference.
NVLink multicast is never used.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

from mlaserve.core import compile_opaque
from mlaserve.kernels.allreduce import (LL_DMAX, LL_ROWS, LLGroup, LLPointers, PeerPointers,
                                        buffer_bytes, ll_buffer_bytes, ll_chunk, peer_all_reduce, peer_all_reduce_ll,
                                        sig_pad_ints)

logger = logging.getLogger(__name__)

MAX_ROWS = 128                  # rows (tokens) of one call: the decode batches the graphs capture
HALF_BYTES = 1 << 20            # bytes of one call's rows: 64 x 7168 bf16 fits
# The model's calls (`fits`) take the peer kernel up to this many bytes, NCCL above (MLASERVE_PEER_MAX_BYTES=N sets
# it, up to HALF_BYTES: A/B runs). On two H200s V3's [64, 7168] calls (896 KiB) stopped both ranks in the peer kernel
# in four of four runs (2026-11-28), from a race on the epoch counter between a program's warps (`kernels/
# allreduce.py`, `advance_epoch`, fixed in 9494828); the bound was 256 KiB until a run confirmed the fix. It did
# (2026-11-29, benchmarks/results/tp-h200x2.md, eighth run): V3 20 layers tp 2 bs 64 on the peer kernel finished at
# 3,054 tok/s, its all-reduces 0.42 ms of the step against NCCL's 0.74 ms the day before, and the peer kernels
# replayed in a decode's order (`benchmarks/peer_stress.py`) finished every phase at hidden 2048 and 7168.
PEER_CALL_MAX_BYTES = HALF_BYTES


class PeerAllReduce:
    """One rank's side: its own buffers, the addresses of every member's, and the launch.

    `members`: the global ranks of the group in group-rank order; `cpu_group`: a gloo group holding at least
    them (every rank of it must construct a PeerAllReduce at the same point, members or not).
    """

    def __init__(self, group_rank: int, members: list[int], cpu_group, device: torch.device,
                 max_rows: int = MAX_ROWS, half_bytes: int = HALF_BYTES):
        self.rank, self.world, self.device = group_rank, len(members), device
        self._keep: list = []                        # shared-memory segments and their tensors (CPU)
        # staging buffer, signal pad, the push variant's receive buffer
        sizes = (buffer_bytes(half_bytes), sig_pad_ints(len(members), max_rows) * 4, ll_buffer_bytes(len(members)))
        if device.type == "cuda":
            self._cu = _Driver()
            torch.cuda.synchronize(device)           # torch has made this device's primary context current
            own_ptrs = [self._cu.alloc_zeroed(n) for n in sizes]
            mine = tuple(self._cu.ipc_handle(ptr) for ptr in own_ptrs)
        else:
            own = [shared_memory.SharedMemory(create=True, size=n) for n in sizes]
            self._keep += own
            tensors = [_shm_tensor(seg, n) for seg, n in zip(own, sizes)]
            for t in tensors[1:]:
                t.zero_()
            self._keep += tensors
            own_ptrs = [t.data_ptr() for t in tensors]
            mine = tuple(seg.name for seg in own)
        everyone: list = [None] * dist.get_world_size(cpu_group)
        dist.all_gather_object(everyone, pickle.dumps(mine), group=cpu_group)
        theirs = [pickle.loads(everyone[dist.get_group_rank(cpu_group, m)]) for m in members]
        ptrs: list[list[int]] = [[] for _ in sizes]           # [kind][member]
        for i, handles in enumerate(theirs):
            for kind, (h, n) in enumerate(zip(handles, sizes)):
                if i == group_rank:
                    ptrs[kind].append(own_ptrs[kind])
                elif device.type == "cuda":
                    ptrs[kind].append(self._cu.ipc_open(h))
                else:
                    seg = shared_memory.SharedMemory(name=h)
                    t = _shm_tensor(seg, n)
                    self._keep += [seg, t]
                    ptrs[kind].append(t.data_ptr())
        dist.barrier(group=cpu_group)                # every rank has mapped every segment
        if device.type != "cuda":
            for seg in own:
                seg.unlink()                         # the mappings stay; nothing is left behind at exit
        bufs, sigs, lls = (torch.tensor(p, dtype=torch.int64, device=device) for p in ptrs)
        self.peers = PeerPointers(group_rank, self.world, bufs, sigs,
                                  torch.zeros(max_rows, dtype=torch.int32, device=device), max_rows, half_bytes)
        self.ll = LLPointers.new(lls)
        # every rank inherits the environment
        self.push_elems, self.kernel_sums, self.max_call_bytes, self.split_rows = peer_settings(os.environ, half_bytes)
        self.ll_group = LLGroup(self.ll, group_rank, self.world)     # for kernels that run the push themselves

    def __repr__(self) -> str:
        return f"PeerAllReduce(rank={self.rank}, world={self.world}, {self.device.type})"

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this call can take x [T, D] (else the caller uses NCCL / gloo): at most `max_call_bytes`."""
        return x.dim() == 2 and x.stride(1) == 1 and x.dtype in _DTYPES and self.peers.fits(x) \
            and x.numel() * x.element_size() <= self.max_call_bytes

    # NOTE: Triton launches stay opaque to torch.compile, as the model's kernels do (layers/ops.py)
    @compile_opaque
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group, in place."""
        if self.pushes(x):
            return peer_all_reduce_ll(x, self.ll_group)
        if chunk := self.split_chunk(x):
            return peer_all_reduce_ll(x, self.ll_group, chunk=chunk)
        return peer_all_reduce(x, self.peers)

    @compile_opaque
    def all_reduce_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(sum + residual) * weight, sum + residual); `residual` is updated in place."""
        if self.pushes(x):
            return peer_all_reduce_ll(x, self.ll_group, residual, weight, eps)
        if chunk := self.split_chunk(x):
            return peer_all_reduce_ll(x, self.ll_group, residual, weight, eps, chunk)
        return peer_all_reduce(x, self.peers, residual, weight, eps), residual

    def pushes(self, x: torch.Tensor) -> bool:
        """Whether a call on x takes the push variant (MLASERVE_PEER_PUSH's rule), given `fits(x)`."""
        return x.numel() <= self.push_elems and self.ll.fits(x)

    def split_chunk(self, x: torch.Tensor) -> int | None:
        """Columns per program where a call on x takes the split push (MLASERVE_PEER_SPLIT's rule: on a GPU, more
        values than the whole-row push takes, at most `split_rows` rows): about SPLIT_COLS; else None."""
        if x.device.type != "cuda" or self.pushes(x) or x.shape[0] > self.split_rows or not self.ll.fits(x):
            return None
        return ll_chunk(x.shape[1], -(-x.shape[1] // SPLIT_COLS))

    # NOTE: tests hold the push variant to the pull one's bits
    def fits_push(self, x: torch.Tensor) -> bool:
        return self.fits(x) and self.ll.fits(x)

    @compile_opaque
    def all_reduce_push(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                        weight: torch.Tensor | None = None, eps: float = 0.0,
                        chunk: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`all_reduce` (no residual) or `all_reduce_add_norm` by the push variant (`fits_push`); `chunk`: columns
        per program (`peer_all_reduce_ll`; not on the model's path until timed)."""
        return peer_all_reduce_ll(x, self.ll_group, residual, weight, eps, chunk)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The push variant is faster for the smallest calls only. Two H100s (NV18), 50 calls in a CUDA graph, us per call,
# pull / push: 1 x 2048 8.4 / 4.6, 1 x 7168 9.1 / 9.4, 4 x 7168 9.3 / 9.0, 8 x 7168 9.5 / 9.9, 16 x 7168 10.1 /
# 11.8; V2-Lite tp 2 decode (hidden 2048) bs 1 349 -> 401 tok/s with push, bs 16 2269 -> 2215
# (benchmarks/results/tp-h200x2.md). With MLASERVE_PEER_PUSH=auto, calls of up to this many elements take it
PUSH_AUTO_ELEMS = 4096


# A row of more values goes out from several programs of about SPLIT_COLS columns each, the norm's sum of squares
# added up between them (`peer_all_reduce_ll`'s chunk). Two H200s, 50 calls in a CUDA graph, us per call, the pull
# kernel / the split push, each with the norm fused: 1 x 7168 6.8 / 5.0, 4 x 7168 6.9 / 5.7, 8 x 7168 7.0 / 6.3,
# 16 x 7168 7.3 / 7.7, 4 x 2048 5.6 / 5.1, 16 x 2048 5.8 / 5.9 (benchmarks/results/tp-h200x2.md, tenth run). With
# MLASERVE_PEER_SPLIT unset, calls of up to this many rows take it
SPLIT_COLS = 1024
SPLIT_AUTO_ROWS = 8


def split_rows(setting: str) -> int:
    """MLASERVE_PEER_SPLIT: the most rows a call of more than the push's values takes the split push with (unset:
    SPLIT_AUTO_ROWS; 0: never; at most LL_ROWS)."""
    if not setting:
        return SPLIT_AUTO_ROWS
    if not setting.isdigit() or int(setting) > LL_ROWS:
        raise ValueError(f"MLASERVE_PEER_SPLIT={setting!r}: expected a number of rows from 0 to {LL_ROWS}")
    return int(setting)


def push_elems(setting: str) -> int:
    """The largest call (rows x hidden) the push variant takes: MLASERVE_PEER_PUSH=auto (default: PUSH_AUTO_ELEMS),
    0 (never), 1 (every call of <= LL_ROWS rows: A/B runs).

    It was off from 2026-11-27 to 2026-11-29: of five V2-Lite tp 2 one-batch runs with it on, two stopped printing
    rows before their limits. The cause, most likely, was the race on the epoch counter that also stopped V3's pull
    calls (`advance_epoch`, fixed in 9494828). After the fix (2026-11-29, two H200s, benchmarks/results/
    tp-h200x2.md, eighth run) V2-Lite tp 2 ran every size with it and the in-kernel sums on (bs 1 429 tok/s against
    411 without), and `benchmarks/peer_stress.py` finished every phase with the push kernel and with the sums."""
    limits = {"auto": PUSH_AUTO_ELEMS, "1": LL_ROWS * LL_DMAX, "0": 0}
    if setting not in limits:
        raise ValueError(f"MLASERVE_PEER_PUSH={setting!r}: expected auto, 1 or 0")
    return limits[setting]


def peer_settings(environ, half_bytes: int) -> tuple[int, bool, int, int]:
    """(push_elems, kernel_sums, max_call_bytes, split_rows) from MLASERVE_PEER_PUSH (default auto),
    MLASERVE_KERNEL_SUMS (default 1), MLASERVE_PEER_MAX_BYTES (default PEER_CALL_MAX_BYTES) and
    MLASERVE_PEER_SPLIT (default SPLIT_AUTO_ROWS)."""
    return (push_elems(environ.get("MLASERVE_PEER_PUSH", "auto")),
            kernel_sums(environ.get("MLASERVE_KERNEL_SUMS", "1")),
            max_call_bytes(environ.get("MLASERVE_PEER_MAX_BYTES", ""), half_bytes),
            split_rows(environ.get("MLASERVE_PEER_SPLIT", "")))


def max_call_bytes(setting: str, half_bytes: int) -> int:
    """MLASERVE_PEER_MAX_BYTES: the largest call (bytes) the model's all-reduces take over the peer buffers; unset or
    empty: PEER_CALL_MAX_BYTES. At most the buffers' half_bytes."""
    if not setting:
        return min(PEER_CALL_MAX_BYTES, half_bytes)
    try:
        n = int(setting)
    except ValueError:
        raise ValueError(f"MLASERVE_PEER_MAX_BYTES={setting!r}: expected a number of bytes") from None
    if not 0 <= n <= half_bytes:
        raise ValueError(f"MLASERVE_PEER_MAX_BYTES={n}: must be between 0 and the peer buffers' {half_bytes} bytes")
    return n


def kernel_sums(setting: str) -> bool:
    """MLASERVE_KERNEL_SUMS=1 (default): where the push variant takes the call, the router sums the attention output
    over the ranks inside its own launch and a one-token MoE layer's experts' combine its output (`TensorParallel.
    push_group`), instead of an all-reduce launch before each. 0: off (an all-reduce launch before each).

    Off from 2026-11-27 to 2026-11-29 (a V2-Lite tp 2 run with it on did not finish bs 64); on since the epoch-race
    fix ran on two H200s (see `push_elems`)."""
    if setting not in ("0", "1"):
        raise ValueError(f"MLASERVE_KERNEL_SUMS={setting!r}: expected 0 or 1")
    return setting == "1"


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]    # CUipcMemHandle


class _Driver:
    """The few CUDA driver calls the peer buffers need, in the calling thread's current context. The memory lives
    as long as the process (a server's ranks keep their groups to the end)."""

    LAZY_ENABLE_PEER_ACCESS = 1                        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        self.lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        self.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        self.lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(err, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({err})")

    def alloc_zeroed(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), "cuMemAlloc")
        self._check(self.lib.cuMemsetD8_v2(ptr.value, 0, nbytes), "cuMemsetD8")
        self._check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")
        return ptr.value

    def ipc_handle(self, ptr: int) -> bytes:
        h = _IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(h), ptr), "cuIpcGetMemHandle")
        return bytes(h.reserved)

    def ipc_open(self, handle: bytes) -> int:
        h, ptr = _IpcHandle.from_buffer_copy(handle), ctypes.c_uint64()
        self._check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, self.LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle")
        return ptr.value


def _shm_tensor(seg: shared_memory.SharedMemory, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes)


def peer_members(rank: int, group_rank: int, size: int) -> list[int]:
    """Global ranks of a tensor-parallel group of consecutive ranks, in group-rank order."""
    first = rank - group_rank
    return list(range(first, first + size))


def why_not_peer(device: torch.device, members: list[int], local_size: int, devices: list[int],
                 cpu: bool = False) -> str | None:
    """Why the group cannot use peer buffers (None: it can): ranks on several nodes, GPUs without peer access, or
    CPU ranks unless `cpu` (shared memory and the interpreter: tests). `devices`: each member's CUDA device index."""
    if len({m // local_size for m in members}) > 1:
        return "the group spans nodes"
    if device.type != "cuda":
        return None if cpu else "the ranks run on the CPU (gloo)"
    me = torch.cuda.current_device()
    for d in devices:
        if d != me and not torch.cuda.can_device_access_peer(me, d):
            return f"cuda:{me} has no peer access to cuda:{d}"
    return None
