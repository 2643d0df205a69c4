"""One rank's model runner: build and load the model, size the latent KV pool, forward a batch, sample.

Legend: `T` new tokens in the batch, `B` requests, `V` vocab.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import NamedTuple

import torch

from mlaserve.attention import create_attn_backend
from mlaserve.config import ModelConfig, ServerConfig
from mlaserve.config_resolve import (default_batch_sizes, describe_changes, probe_device, require_resolved,
                                     resolve_config)
from mlaserve.core import Batch, ForwardMode
from mlaserve.distributed import ParallelInfo, RankGroup, TensorParallel
from mlaserve.distributed.expert import expert_parallel
from mlaserve.draft_checkpoint import draft_checkpoint
from mlaserve.engine.forward_batch import build_context, upload_ints
from mlaserve.engine.spec import PendingSpec, SpecDecoder, SpecOutput, widen
from mlaserve.kernels import pdl
from mlaserve.kernels.mla_decode import choose_num_kv_splits, decode_programs
from mlaserve.kernels.sampling import greedy_ids
from mlaserve.kvcache.allocator import to_device
from mlaserve.kvcache.pool import KV_CACHE_DTYPES, MLAKVPool, kv_bytes_per_token
from mlaserve.layers.sampler import Sampler, SamplingBatch, logprobs_of, top_logprobs
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_token_map, load_weights

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class StepOutput(NamedTuple):
    """Per request of the batch: the sampled token (None for a non-final prompt chunk) and log-probs."""

    next_ids: list[int | None]
    next_logprobs: list[float | None]
    next_top: list[list[tuple[float, int]] | None]
    input_logprobs: list[list[tuple[float, int]]]          # prompt positions covered by this step
    input_top: list[list[list[tuple[float, int]]]]
    spec: SpecOutput | None = None           # a mixed batch under speculative decoding: its decodes' verify results


class ForwardStep(NamedTuple):
    """A forward queued on the device, its sampling not yet (`ModelRunner.launch_sample`)."""

    batch: Batch
    logits: torch.Tensor                  # [len(rows), V] fp32
    rows_dev: torch.Tensor                # [B] request rows on the device
    prompt_rows: list[list[int]]
    sample_row: list[int | None]
    spec: PendingSpec | None = None          # a mixed batch under speculative decoding: its decodes' step


class PendingStep(NamedTuple):
    """A step queued on the device: its sampled ids (and log-probs) arrive in host buffers at `event`."""

    batch: Batch
    samplers: list[int]
    next_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None
    prompt: tuple[list, list]
    event: "torch.cuda.Event | None"
    spec: PendingSpec | None = None


def resolve_for_device(server: ServerConfig, model_path: str) -> ServerConfig:
    """`resolve_config` against the checkpoint at `model_path` and the device this process runs on (logged)."""
    resolved = resolve_config(server, ModelConfig.from_hf(model_path), probe_device(server.load.device))
    changes = describe_changes(server, resolved)
    if changes:
        logger.info("resolved: %s", changes)
    return resolved


def kv_pool_tokens(budget_bytes: float, bytes_per_token: int, min_tokens: int = 256) -> int:
    """Token slots a KV budget holds; raises when it holds fewer than `min_tokens`."""
    if budget_bytes < bytes_per_token * min_tokens:
        raise RuntimeError(f"not enough GPU memory for the KV pool ({budget_bytes / 2**30:.2f} GiB left after "
                           "weights); raise --mem-fraction-static, use --kv-cache-dtype fp8_e4m3, or a smaller model")
    return int(budget_bytes // bytes_per_token)


class ModelRunner:
    """Builds and runs the model for a config already through `resolve_config` (no automatic choice here).

    Under tensor parallelism one runner per rank, `group` joining them: each holds its shard of the weights and
    a whole latent KV pool, of the size every rank can hold; every rank computes the same logits."""

    def __init__(self, server: ServerConfig, model_path: str | None, group: RankGroup | None = None):
        require_resolved(server)
        load = server.load
        self.server = server
        self.group = group or RankGroup(ParallelInfo(), TensorParallel(), None)
        self.device = torch.device(load.device)
        self.dtype = DTYPES[load.dtype]
        self.cfg = ModelConfig.from_hf(model_path) if model_path else None
        if self.cfg is None:
            raise ValueError("no model path")
        self.context_len = load.context_length
        kernels = load.attention_backend
        sched = server.sched
        spec_steps = sched.speculative_num_steps if sched.speculative_algorithm else 0
        draft = draft_checkpoint(sched.speculative_draft_model_path, model_path, self.cfg) if spec_steps else None
        if draft is not None:                       # the MTP layer is built for, and loaded from, the draft's
            self.cfg = self.cfg.with_(num_nextn_predict_layers=1)
        # NOTE: a verify step reaches spec_steps positions past the last token a request may have; under overlap a
        # step queued after its last one starts up to spec_steps + 1 further (its results are discarded)
        self.model = DeepseekForCausalLM(self.cfg, dtype=self.dtype, device=self.device, kernels=kernels,
                                         absorb=not load.disable_mla, dequant_fp8=load.dequant_fp8,
                                         load_mtp=spec_steps > 0, max_pos=self.context_len + 2 * spec_steps + 2,
                                         tp=self.group.tp, dp=self.group.dp,
                                         ep=expert_parallel(self.group.dp.world if self.group.dp else self.group.tp,
                                                            server.parallel.ep_size),
                                         dense_tp=TensorParallel() if server.parallel.moe_dense_tp_size == 1 else None,
                                         moe_all_to_all=server.parallel.moe_dispatch == "all_to_all")
        load_weights(self.model, self.cfg, model_path, load_format=load.load_format, dequant_fp8=load.dequant_fp8,
                     seed=load.seed, progress=self.group.info.is_leader, draft=draft)
        if spec_steps and sched.speculative_token_map:
            self._restrict_draft_vocab(sched.speculative_token_map, sched.speculative_eagle_topk or 1)
        logger.info("weights: %.2f GiB on rank %d of %d", weight_bytes(self.model) / 2**30, self.group.info.rank,
                    self.group.size)
        if self.device.type == "cuda" and kernels == "triton":
            logger.info("Triton kernels: programmatic dependent launch %s", "on" if pdl.active(self.device)
                        else "off (MLASERVE_PDL=0, or a GPU below compute capability 9.0)")
        kv_dtype = KV_CACHE_DTYPES[server.cache.kv_cache_dtype]
        self.num_slots = self.group.min_int(self._pool_size(kv_dtype))          # every rank holds the whole cache
        self.pool = MLAKVPool(self.num_slots, self.model.num_kv_layers, self.cfg.kv_lora_rank,
                              self.cfg.qk_rope_head_dim, kv_dtype, self.device)
        self.attn_backend = create_attn_backend(kernels, self.cfg.softmax_scale, self.cfg.kv_lora_rank,
                                                self.cfg.qk_rope_head_dim)
        self.sampler = Sampler(use_triton=kernels == "triton")
        self.req_to_token: torch.Tensor | None = None      # set by attach() (the scheduler's table)
        self.token_buf: torch.Tensor | None = None
        self.extends_as_decode = 0                # extend batches run as decode steps (`_decodes_alone`)
        self.graphs = None
        self.pieces = None                                 # piecewise extend graphs (init_cuda_graphs)
        self.spec = SpecDecoder(self, spec_steps, sched.speculative_eagle_topk or 1,
                                sched.speculative_num_draft_tokens) if spec_steps else None
        logger.info("KV pool: %d token slots (%.1f MiB, %s)", self.num_slots,
                    self.pool.bytes_per_token() * self.num_slots / 2**20, kv_dtype)

    def _restrict_draft_vocab(self, path: str, topk: int) -> None:
        ids = load_token_map(path, self.cfg.vocab_size)
        if len(ids) < topk:
            raise ValueError(f"--speculative-token-map {path}: {len(ids)} token ids, fewer than "
                             f"--speculative-eagle-topk {topk}")
        self.model.mtp.restrict_vocab(ids)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()          # the whole head's rows: not "used by others" when the pool is sized
        logger.info("draft head: %d of %d tokens (--speculative-token-map)", len(ids), self.cfg.vocab_size)

    def _pool_size(self, kv_dtype: torch.dtype) -> int:
        cache = self.server.cache
        if cache.max_total_tokens:                    # given, or the CPU default (resolve_config)
            return cache.max_total_tokens
        # NOTE: blocks torch's allocator keeps from loading (dummy weights drawn in fp32, FP8 shards cast on the
        # GPU) go back first: left reserved, they count below as used by others. On two H100s (V3, 10 layers) the
        # pools were sized with 10-14 GiB per rank so counted (benchmarks/results/dp-ep-h200x2.md)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        budget = (total * cache.mem_fraction_static - torch.cuda.memory_allocated(self.device) - used_by_others
                  - self._graph_reserve())
        return kv_pool_tokens(budget, kv_bytes_per_token(self.model.num_kv_layers, self.cfg.kv_cache_dim, kv_dtype))

    def _graph_reserve(self) -> int:
        """Memory kept out of the KV pool for decode activations and CUDA-graph buffers (logits dominate)."""
        sched = self.server.sched
        rows = sched.cuda_graph_max_bs * (sched.speculative_num_draft_tokens if sched.speculative_algorithm else 1)
        return 512 * 2**20 + 3 * rows * self.cfg.vocab_size * 4

    def init_cuda_graphs(self, req_to_token: torch.Tensor, dummy_req: int) -> None:
        """Capture decode graphs unless the resolved config turned them off (CPU, torch kernels, --disable-mla,
        --disable-cuda-graph)."""
        sched = self.server.sched
        if sched.enable_mixed_chunk and self.device.type == "cuda":
            self.warm_mixed_decode(req_to_token, dummy_req)
        if sched.disable_cuda_graph and not sched.torch_compile_max_bs:
            return
        with self.model.moe_gather():             # graphs capture the MoE's gather, never its all-to-all
            self._capture_graphs(req_to_token, dummy_req, capture=not sched.disable_cuda_graph)

    def _capture_graphs(self, req_to_token: torch.Tensor, dummy_req: int, capture: bool = True) -> None:
        """`capture=False` (torch.compile without graphs): the same runners, their padded forwards compiled and run
        eagerly at the sizes graphs would use up to --torch-compile-max-bs, each compiled here (`warm`)."""
        from mlaserve.engine.graph import DecodeGraphRunner

        sched = self.server.sched
        sizes = sched.cuda_graph_bs if capture else default_batch_sizes(sched.torch_compile_max_bs)
        if not capture:
            logger.info("torch.compile without CUDA graphs: decode batches up to %d run compiled, eagerly (bs %s)",
                        sched.torch_compile_max_bs, sizes)
        if sched.piecewise_cuda_graph_max_tokens:
            from mlaserve.engine.piecewise import PiecewiseGraphRunner, default_token_sizes

            self.pieces = PiecewiseGraphRunner(self.model, self.pool, self.attn_backend, req_to_token, dummy_req,
                                               default_token_sizes(sched.piecewise_cuda_graph_max_tokens),
                                               self.device, dp_size=self.dp_size)
        if self.spec is not None:                 # every decode step is a speculative one
            from mlaserve.engine.graph import SpecGraphRunner

            self.spec.graphs = SpecGraphRunner(self.spec, req_to_token, dummy_req, sizes,
                                               min(self.context_len, self.num_slots), self.device,
                                               compile_max_bs=sched.torch_compile_max_bs, dp_size=self.dp_size,
                                               capture=capture, warm=not capture)
            return
        self.graphs = DecodeGraphRunner(self.model, self.pool, self.attn_backend, req_to_token, dummy_req,
                                        sizes, min(self.context_len, self.num_slots), self.device,
                                        self.token_buf, compile_max_bs=sched.torch_compile_max_bs,
                                        dp_size=self.dp_size, capture=capture, warm=not capture)

    @property
    def dp_size(self) -> int | None:
        """DP attention's group count (the graphs capture every group's rows in each MoE gather), else None."""
        return self.group.dp.dp_size if self.group.dp is not None else None

    @torch.no_grad()
    def warm_mixed_decode(self, req_to_token: torch.Tensor, dummy_req: int) -> None:
        """Compile, before the first request, every variant of the kernels that a mixed batch's decodes run eagerly
        (--enable-mixed-chunk): the absorbed attention at each decode count up to --max-running-requests and each
        split count the host may choose for it. Compiled on first use instead, a variant stalled a serving step by
        0.2-1.5 s (benchmarks/results/piecewise-h100.md). The dummy request reads and writes the padding slot."""
        attn = self.model.model.layers[0].self_attn
        if not attn.absorb:                         # --disable-mla: the decodes run the extend form, nothing apart
            return
        t0, h = time.monotonic(), self.model.num_local_heads
        req_to_token[dummy_req, 0] = 0
        for n in range(1, self.server.sched.max_running_requests + 1):
            ctx = build_context(ForwardMode.DECODE, req_pool_idx=[dummy_req] * n, prefix_lens=[0] * n,
                                extend_lens=[1] * n, out_slots=torch.zeros(n, dtype=torch.int64),
                                req_to_token=req_to_token, kv_pool=self.pool, attn_backend=self.attn_backend,
                                device=self.device, last_token_logits=False)
            q = torch.zeros(n, h, attn.dn + attn.r, dtype=self.dtype, device=self.device)
            most = choose_num_kv_splits(decode_programs(n, h), 1 << 30)
            for splits in sorted({most} | {1 << i for i in range(most.bit_length())}):
                ctx.num_kv_splits = splits
                attn.attend_absorbed(q, ctx)
        logger.info("mixed-batch decode kernels warmed for 1..%d decodes in %.1f s",
                    self.server.sched.max_running_requests, time.monotonic() - t0)

    # --- one step ----------------------------------------------------------------------------
    def _logit_rows(self, batch: Batch) -> tuple[list[int], list[list[int]], list[int | None]]:
        """Rows of T whose logits are needed: prompt log-prob positions per request, and the sampling row."""
        rows, prompt_rows, sample_row = [], [], []
        start = 0
        for i, (req, p, n, s) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sampling)):
            mine = []
            if req.return_logprob and not batch.is_decode(i):
                # logits at position q predict token q + 1; wanted for q + 1 in [logprob_start, len(prompt))
                lo, hi = max(p, req.logprob_start - 1), min(p + n, len(req.input_ids) - 1)
                mine = [start + q - p for q in range(lo, hi)]
            prompt_rows.append(list(range(len(rows), len(rows) + len(mine))))
            rows.extend(mine)
            if s:
                sample_row.append(len(rows))
                rows.append(start + n - 1)
            else:
                sample_row.append(None)
            start += n
        return rows, prompt_rows, sample_row

    def attach(self, req_to_token: torch.Tensor) -> None:
        """Use the scheduler's request-to-token table; `token_buf[row]` holds each request's last sampled token."""
        self.req_to_token = req_to_token
        self.token_buf = torch.zeros(req_to_token.shape[0], dtype=torch.int64, device=self.device)
        if self.spec is not None:
            self.spec.attach(req_to_token.shape[0])

    def forward(self, batch: Batch) -> StepOutput:
        return self.resolve(self.launch(batch))

    @torch.no_grad()
    def launch(self, batch: Batch, bitmask: torch.Tensor | None = None) -> PendingStep:
        """Queue the step on the GPU and return without waiting; `resolve` fetches its results.

        Decode inputs are read on the GPU from `token_buf` (written by the step that sampled them), so step
        N + 1 can be queued before step N's tokens reach the CPU (the overlap scheduler). `bitmask`: see
        `launch_sample`."""
        return self.launch_sample(self.launch_forward(batch), bitmask)

    @torch.no_grad()
    def launch_forward(self, batch: Batch) -> ForwardStep:
        """Queue the model forward only; `launch_sample` queues the sampling (the CPU may work in between)."""
        pool_rows = [r.req_pool_idx for r in batch.reqs]
        if batch.mode is ForwardMode.DECODE and self.group.dp is None and self.graphs is not None \
                and self.graphs.can_run(batch.size):
            # the graph's inputs: one pinned copy; its input tokens are token_buf's (no host round trip). The rows
            # wanted for sampling are worked out while the GPU runs it (a synchronous step waits for nothing else).
            logits, rows_dev = self.graphs.replay_host(batch.prefix_lens, batch.out_slots, pool_rows)
            _, prompt_rows, sample_row = self._logit_rows(batch)
            return ForwardStep(batch, logits, rows_dev, prompt_rows, sample_row)
        rows, prompt_rows, sample_row = self._logit_rows(batch)
        if self._decodes_alone(batch, prompt_rows):
            # every request computes one token over its cached KV, which is what a decode step does (the absorbed
            # attention reads the latent cache as it is; the extend form would expand the whole cached prefix):
            # a fully cached prompt's last token, alone or with --enable-mixed-chunk's decodes. Its input token goes
            # to token_buf, where a decode step reads it. The batch stays an extend for sampling and results.
            ext = batch.size - batch.num_decode
            ext_rows, ext_ids = upload_ints([pool_rows[:ext], batch.input_ids[:ext]], self.device)  # one upload
            self.token_buf[ext_rows] = ext_ids
            self.extends_as_decode += 1
            return self.launch_forward(replace(batch, mode=ForwardMode.DECODE, num_decode=0))._replace(batch=batch)
        if batch.graph_bs is not None:            # DP attention: every rank replays the agreed size (IDLE: padding)
            logits, rows_dev = self.graphs.replay_host(batch.prefix_lens, batch.out_slots, pool_rows, batch.graph_bs,
                                                       batch.global_num_tokens)
            return ForwardStep(batch, logits, rows_dev, prompt_rows, sample_row)
        logits, rows_dev, spec = self._logits(batch, rows, pool_rows)
        return ForwardStep(batch, logits, rows_dev, prompt_rows, sample_row, spec)

    def _decodes_alone(self, batch: Batch, prompt_rows: list[list[int]]) -> bool:
        """An extend batch of one new token per request, each sampled and none wanting prompt log-probs, that can
        run as a decode step: one process per DP group's batch (no agreed sizes), no speculative decoding (its
        extends also run the draft layer), the absorbed attention."""
        return (batch.mode is ForwardMode.EXTEND and batch.graph_bs is None and batch.piece_tokens is None
                and self.group.dp is None and self.spec is None and self.model.model.layers[0].self_attn.absorb
                and all(n == 1 for n in batch.extend_lens) and all(batch.sampling)
                and not any(prompt_rows))

    @torch.no_grad()
    def launch_sample(self, fwd: ForwardStep, bitmask: torch.Tensor | None = None) -> PendingStep:
        """Queue the sampling of a forward queued by `launch_forward`.

        Args:
            bitmask: [B, W] int32 host tensor, one row per request of the batch: the tokens each may sample
                (structured output; `layers/sampler.apply_token_bitmask`), or None for no constraint."""
        batch, logits = fwd.batch, fwd.logits
        samplers = [i for i in range(batch.size) if fwd.sample_row[i] is not None]
        ids = lp = top = None
        if samplers:
            mask = to_device(bitmask[samplers], self.device) if bitmask is not None else None
            ids, lp, top = self._sample(batch, _take_rows(logits, [fwd.sample_row[i] for i in samplers]), samplers,
                                        mask)
            self.token_buf[_take_rows(fwd.rows_dev, samplers)] = ids
        prompt = self._prompt_logprobs(batch, logits, fwd.prompt_rows)
        host = [t.to("cpu", non_blocking=True) if t is not None else None for t in (ids, lp)]
        top = tuple(t.to("cpu", non_blocking=True) for t in top) if top is not None else None
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingStep(batch, samplers, host[0], host[1], top, prompt, event, fwd.spec)

    @torch.no_grad()
    def launch_spec(self, batch: Batch, draft_bitmask=None) -> PendingSpec:
        """Queue a draft-and-verify step (a decode batch under speculative decoding); `resolve` fetches it."""
        return self.spec.launch(batch, draft_bitmask)

    def resolve(self, p: PendingStep | PendingSpec) -> StepOutput | SpecOutput:
        if isinstance(p, PendingSpec):
            return self.spec.resolve(p)
        if p.event is not None:
            p.event.synchronize()
        b = p.batch.size
        next_ids: list[int | None] = [None] * b
        next_lp: list[float | None] = [None] * b
        next_top: list = [None] * b
        ids = p.next_ids.tolist() if p.next_ids is not None else []
        lps = p.logprobs.tolist() if p.logprobs is not None else None
        tops = [t.tolist() for t in p.top] if p.top is not None else None
        for j, i in enumerate(p.samplers):
            next_ids[i] = ids[j]
            req = p.batch.reqs[i]
            if req.return_logprob and lps is not None:
                next_lp[i] = lps[j]
                if tops is not None and req.top_logprobs_num:
                    k = req.top_logprobs_num
                    next_top[i] = list(zip(tops[0][j][:k], tops[1][j][:k]))
        spec = self.spec.resolve(p.spec) if p.spec is not None else None
        return StepOutput(next_ids, next_lp, next_top, *p.prompt, spec=spec)

    def _logits(self, batch: Batch, rows: list[int],
                pool_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, PendingSpec | None]:
        """(the logits of the batch's token rows `rows` [len(rows), V] fp32, the requests' pool rows `pool_rows` on
        the device, a mixed batch's decode step under speculative decoding or None)."""
        if batch.mode is ForwardMode.IDLE:                                     # DP attention: no tokens here
            # the other groups extend through the pieces (agreed): this group's padding rows in their gathers
            target = self.model.forward_idle if batch.piece_tokens is None else \
                lambda _counts: self.pieces.run_idle(batch.piece_tokens)
            if self.spec is not None:
                self.spec.idle(batch.slot_tokens, target)
            else:
                target(batch.global_num_tokens)
            return (torch.empty(0, self.cfg.vocab_size, device=self.device),
                    torch.empty(0, dtype=torch.int64, device=self.device), None)
        if batch.mode is not ForwardMode.DECODE and self.spec is not None:
            return self._spec_extend_logits(batch, rows, pool_rows)
        extend = batch.mode is ForwardMode.EXTEND
        # the token ids (an extend's), positions, slots, pool rows, lengths and logit rows: one upload
        ctx = build_context(batch.mode, req_pool_idx=pool_rows, prefix_lens=batch.prefix_lens,
                            extend_lens=batch.extend_lens, out_slots=batch.out_slots, req_to_token=self.req_to_token,
                            kv_pool=self.pool, attn_backend=self.attn_backend, device=self.device,
                            last_token_logits=False, num_decode=batch.num_decode, logits_rows=rows,
                            input_ids=batch.input_ids if extend else None)
        rows_dev = ctx.req_pool_idx
        if not extend:
            ids = self.token_buf[rows_dev]                                     # [B] last sampled tokens
        else:
            ids = ctx.input_ids
            if batch.num_decode:                     # a mixed batch: its decodes' inputs are on the device
                ids[-batch.num_decode:] = self.token_buf[rows_dev[-batch.num_decode:]]
        self._mixed_splits(ctx)
        ctx.global_num_tokens = batch.global_num_tokens
        return self._forward_model(ids, ctx, batch.piece_tokens).logits, rows_dev, None

    def _mixed_splits(self, ctx) -> None:
        """A mixed batch's decodes: their split count of the decode kernel, chosen on the host (the kernel's own
        choice syncs)."""
        if ctx.parts is not None:
            dec = ctx.parts[1]
            dec.num_kv_splits = choose_num_kv_splits(
                decode_programs(dec.batch_size, dec.num_q * self.model.num_local_heads), max(dec.seq_lens_cpu))

    def _forward_model(self, ids: torch.Tensor, ctx, piece_tokens: int | None = None):
        """The model's forward, through the piecewise extend graphs where they take the batch: under DP attention
        those of `piece_tokens` tokens when the ranks agreed on them (`Batch.piece_tokens`), else eagerly."""
        if piece_tokens is not None:
            return self.pieces.run(ids, ctx, pad_to=piece_tokens)
        if self.pieces is not None and self.pieces.can_run(ctx):
            return self.pieces.run(ids, ctx)
        return self.model(ids, ctx.positions, ctx)

    def _spec_extend_logits(self, batch: Batch, rows: list[int],
                            pool_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, PendingSpec | None]:
        """An extend under speculative decoding: the target over the widened batch (`spec.widen`), then the
        draft layer over the same tokens. A mixed batch's decodes (--enable-mixed-chunk, its last num_decode
        requests) draft first, their last tokens and drafts are verified in the last rows of the same target
        forward, and their accept follows it (`SpecDecoder.mixed_drafts` / `mixed_accept`). Returns what `_logits`
        does."""
        n = batch.num_decode
        k = batch.extend_lens[-1] if n else 0                       # the decodes' slots each (`slots_per_step`)
        head = batch if not n else replace(
            batch, reqs=batch.reqs[:-n], input_ids=batch.input_ids[:-n * k], out_slots=batch.out_slots[:-n * k],
            prefix_lens=batch.prefix_lens[:-n], extend_lens=batch.extend_lens[:-n], sampling=batch.sampling[:-n],
            num_decode=0)
        wide = widen(head)
        t = len(wide.ids)                                            # the prompts' rows (then the decodes')
        logit_rows = wide.index[torch.tensor(rows, dtype=torch.int64)]
        prefix, ext, out_slots, ids = wide.prefix_lens, wide.extend_lens, wide.out_slots, wide.ids
        slots = batch.slot_tokens                          # DP attention: agreed counts ([forward][group])
        s = self.spec.steps
        tail = self.spec.mixed_drafts(batch, slots[:s] if slots is not None else None) if n else None
        if tail is not None:                   # the decodes' verify rows after the prompts' (`split_mixed`)
            nodes = tail.tree.tokens.shape[1]
            logit_rows = torch.cat([logit_rows, torch.arange(t, t + n * nodes)])
            prefix, ext = prefix + batch.prefix_lens[-n:], ext + [nodes] * n
            # NOTE: node m of a request's tree goes to its step's column L + m (the slots are on the device)
            out_slots = torch.cat([out_slots.to(self.device), tail.slots[:, :nodes].reshape(-1)])
            ids = ids + [0] * (n * nodes)
        ctx = build_context(ForwardMode.EXTEND, req_pool_idx=pool_rows, prefix_lens=prefix, extend_lens=ext,
                            out_slots=out_slots, req_to_token=self.req_to_token, kv_pool=self.pool,
                            attn_backend=self.attn_backend, device=self.device, last_token_logits=False,
                            num_decode=n, logits_rows=logit_rows, input_ids=ids)
        ids = ctx.input_ids
        if tail is not None:
            ids[t:] = tail.tree.tokens.reshape(-1)
            if self.spec.topk > 1:              # a tree's nodes sit at L + depth (a chain's at L + j, as uploaded)
                ctx.positions[t:] = (tail.base[:, None] + tail.tree.depth).reshape(-1)
                ctx.parts[1].tree_mask = tail.tree.mask.reshape(-1)
            self._mixed_splits(ctx)
        if slots is not None:
            if tail is None:
                self.spec.idle(slots[:s])                                      # other groups' drafts
            ctx.global_num_tokens = slots[s]
        out = self._forward_model(ids, ctx, batch.piece_tokens)
        if tail is None:
            self.spec.after_extend(batch, wide, out.hidden, slots[s + 1] if slots is not None else None)
            self.spec.idle_repair(slots[s + 2] if slots is not None else None)
            return out.logits, ctx.req_pool_idx, None
        self.spec.after_extend(head, wide, out.hidden[:t], slots[s + 1] if slots is not None else None)
        pending = self.spec.mixed_accept(tail, out.logits[len(rows):], out.hidden[t:],
                                         slots[s + 2] if slots is not None else None)
        return out.logits[:len(rows)], ctx.req_pool_idx, pending

    @torch.no_grad()
    def spec_step(self, batch: Batch, draft_bitmask=None) -> SpecOutput:
        """One draft-and-verify step over a decode batch holding `spec_tree.slots_per_step` slots per request.
        `draft_bitmask` (structured output): the drafts on each verified node's path [B][N][depth] -> [B * N, W]
        int32 allowed tokens at each verified node."""
        return self.spec.step(batch, draft_bitmask)

    def _sample(self, batch: Batch, logits: torch.Tensor, samplers: list[int], bitmask: torch.Tensor | None = None):
        """logits [n, V] of the sampling rows -> (ids [n], chosen log-probs | None, top (values, ids) | None)."""
        reqs = [batch.reqs[i] for i in samplers]
        steps = [self._step_index(batch, i) for i in samplers]
        if bitmask is None and self._plain_greedy(reqs, steps):
            return greedy_ids(logits, self.sampler.use_triton), None, None
        sb = SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs], steps,
                                 [r.input_ids for r in reqs], [r.output_ids for r in reqs], self.cfg.vocab_size,
                                 self.eos_ids(), self.device)
        sb.token_bitmask = bitmask
        want_lp = any(r.return_logprob for r in reqs)
        k = max(r.top_logprobs_num for r in reqs)
        out = self.sampler(logits, sb, return_logprob=want_lp, top_logprobs_num=k if want_lp else 0)
        return out.next_ids, out.logprobs, out.top_logprobs

    @staticmethod
    def _step_index(batch: Batch, i: int) -> int:
        """Tokens the request had sampled before this step (its RNG counter), exact even while the previous
        step's token is still in flight: a decode step's input is output token number prefix_len - prompt."""
        req = batch.reqs[i]
        if batch.is_decode(i):
            return batch.prefix_lens[i] - len(req.input_ids) + 1
        return len(req.output_ids)

    @staticmethod
    def _plain_greedy(reqs: list, steps: list[int]) -> bool:
        """Greedy, no penalties or bias, no min_new_tokens, no log-probs: the argmax alone (skips SamplingBatch)."""
        for r, step in zip(reqs, steps):
            if r.return_logprob or r.params.needs_sampler or r.params.min_new_tokens > step:
                return False
        return True

    def _prompt_logprobs(self, batch: Batch, logits: torch.Tensor, prompt_rows: list[list[int]]):
        in_lp: list[list[tuple[float, int]]] = [[] for _ in batch.reqs]
        in_top: list[list[list[tuple[float, int]]]] = [[] for _ in batch.reqs]
        for i, (req, rows) in enumerate(zip(batch.reqs, prompt_rows)):
            if not rows:
                continue
            first_q = max(batch.prefix_lens[i], req.logprob_start - 1)
            targets = req.input_ids[first_q + 1: first_q + 1 + len(rows)]
            sel = logits[rows]
            lp = logprobs_of(sel, torch.tensor(targets, device=sel.device)).tolist()
            in_lp[i] = list(zip(lp, targets))
            if req.top_logprobs_num:
                v, ids = top_logprobs(sel, req.top_logprobs_num)
                in_top[i] = [list(zip(a, b)) for a, b in zip(v.tolist(), ids.tolist())]
        return in_lp, in_top

    def eos_ids(self) -> list[int]:
        return [] if self.cfg.eos_token_id is None else [self.cfg.eos_token_id]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters (its shards under tensor parallelism)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] without a device sync: all rows in order is `t` itself, others are indexed by a device copy."""
    if rows == list(range(t.shape[0])):
        return t
    return t[to_device(torch.tensor(rows, dtype=torch.int64), t.device)]
