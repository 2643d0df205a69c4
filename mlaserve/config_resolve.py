"""Config resolution: a `ServerConfig` + the checkpoint's `ModelConfig` + the device -> the config that runs.

`resolve_config` is pure: every "auto" (or unset default) becomes a value, and every flag either acts or is
rejected with one line naming it (`ConfigError`). The scheduler process resolves once against the probed device
and reports the result; the main process resolves once before spawning (device details not probed) so a bad
combination fails before any process starts. Resolving a resolved config returns it unchanged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from mlaserve.config import (CacheConfig, ConfigError, LoadConfig, ModelConfig, ParallelConfig, SchedConfig,
                             ServerConfig)
from mlaserve.draft_checkpoint import draft_checkpoint

DEFAULT_MAX_RUNNING = {"cuda": 256, "cpu": 64}
CPU_DEFAULT_TOKENS = 32768                 # KV-pool size on the CPU (no device memory to size it from)
DEFAULT_MEM_FRACTION = 0.85
DEFAULT_CUDA_GRAPH_MAX_BS = 160
DEFAULT_TORCH_COMPILE_MAX_BS = 32
DEFAULT_PIECEWISE_MAX_TOKENS = 4096
DEFAULT_DIST_TIMEOUT = 600.0              # seconds a collective waits for the other ranks
FP8_E4M3_MIN_CAPABILITY = (8, 9)           # Triton's e4m3 (fp8e4nv) needs Ada / Hopper or newer
FP8_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class DeviceInfo:
    """The device a scheduler runs on. Unprobed details (main process) are "" / 0 / None."""

    type: str                                  # "cuda" or "cpu"
    index: int | None = None
    name: str = ""                             # e.g. "NVIDIA H100 80GB HBM3"
    total_memory: int = 0                      # bytes
    capability: tuple[int, int] | None = None  # CUDA compute capability
    triton: bool = False                       # Triton kernels run here (a GPU, or the CPU under TRITON_INTERPRET=1)

    @property
    def torch_name(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def probe_device(name: str, details: bool = True) -> DeviceInfo:
    """The device `--device name` means here. `details=False` reads no device properties (no CUDA context);
    `--device cpu` imports no torch (the HTTP process probes before the ranks start)."""
    if name != "cpu":
        import torch

        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return DeviceInfo("cpu", triton=os.environ.get("TRITON_INTERPRET") == "1")
    kind, _, idx = name.partition(":")
    if kind != "cuda" or (idx and not idx.isdigit()):
        raise ConfigError(f"--device {name}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available here")
    index = int(idx or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if not details:
        return DeviceInfo("cuda", index, triton=True)
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo("cuda", index, p.name, p.total_memory, (p.major, p.minor), triton=True)


def default_batch_sizes(max_bs: int) -> list[int]:
    """CUDA-graph batch sizes: 1, 2, 4, 8, then every 8 up to max_bs (the ladder users know)."""
    ladder = [1, 2, 4, 8] + list(range(16, max_bs + 1, 8))
    return sorted({b for b in ladder if b <= max_bs} | {max_bs})


def resolve_config(server: ServerConfig, model: ModelConfig, device: DeviceInfo) -> ServerConfig:
    """The config with every automatic choice made for `model` on `device`; raises `ConfigError` (one line
    naming the flags) for a combination that cannot run. Pure and idempotent."""
    _check_choices(server)
    load = _resolve_load(server.load, model, device)
    parallel = _resolve_parallel(server.parallel, model, load, device)
    cache = _resolve_cache(server.cache, load, device)
    sched = _resolve_spec(_resolve_sched(server.sched, load, device, cache), model, load)
    return replace(server, load=load, parallel=parallel, cache=cache, sched=sched)


def require_resolved(server: ServerConfig) -> None:
    """Raise ValueError when `server` still holds automatic values (a caller skipped `resolve_config`)."""
    load, sched = server.load, server.sched
    auto = [n for n, v in (("device", load.device), ("dtype", load.dtype), ("load_format", load.load_format),
                           ("attention_backend", load.attention_backend),
                           ("kv_cache_dtype", server.cache.kv_cache_dtype)) if v == "auto"]
    auto += [n for n, v in (("context_length", load.context_length), ("cuda_graph_max_bs", sched.cuda_graph_max_bs),
                            ("max_running_requests", sched.max_running_requests),
                            ("torch_compile_max_bs", sched.torch_compile_max_bs)) if v is None]
    if auto:
        raise ValueError(f"unresolved config ({', '.join(auto)}): pass it through resolve_config first")


def resolved_args(server: ServerConfig) -> dict:
    """The resolved load / parallel / cache / sched values, flat (what the scheduler reports as ready)."""
    return {f.name: getattr(getattr(server, s), f.name) for s in server.SECTIONS for f in fields(getattr(server, s))}


def describe_changes(before: ServerConfig, after: ServerConfig) -> str:
    """`flag=value` for every value resolution chose (for the log)."""
    a, b = resolved_args(before), resolved_args(after)
    return ", ".join(f"{k}={b[k]}" for k in b if a[k] != b[k])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _reject(msg: str) -> None:
    raise ConfigError(msg)


def _check_choices(server: ServerConfig) -> None:
    # argparse checks `choices` on the command line; the Engine API's keyword arguments arrive unchecked.
    owners = [(server.load, fields(server.load)), (server.parallel, fields(server.parallel)),
              (server.cache, fields(server.cache)),
              (server.sched, fields(server.sched)), (server, [f for f in fields(server) if f.name not in server.SECTIONS])]
    for owner, owned in owners:
        for f in owned:
            value, choices = getattr(owner, f.name), f.metadata.get("choices")
            ok = choices is None or value is None or value in choices \
                or (f.name == "kv_cache_dtype" and value == server.load.dtype)
            if not ok:
                _reject(f"{_flag(f.name)} {value}: choose one of {', '.join(choices)}")


def _resolve_parallel(p: ParallelConfig, model: ModelConfig, load: LoadConfig, device: DeviceInfo) -> ParallelConfig:
    for name in ("tp_size", "dp_size", "nnodes"):
        if getattr(p, name) < 1:
            _reject(f"{_flag(name)} {getattr(p, name)}: must be >= 1")
    if p.enable_ep_moe:             # SGLang 0.4's meaning: expert parallelism over every rank
        if p.ep_size not in (1, p.tp_size):
            _reject(f"--enable-ep-moe --ep-size {p.ep_size}: --enable-ep-moe means --ep-size {p.tp_size} (the "
                    f"--tp-size); give one of the two")
        if p.tp_size == 1:
            _reject("--enable-ep-moe: expert parallelism needs --tp-size > 1 (the experts are split over the ranks)")
        p = replace(p, ep_size=p.tp_size)
    _check_dp_attention(p)
    if p.tp_size % p.nnodes:
        _reject(f"--tp-size {p.tp_size} --nnodes {p.nnodes}: every node runs the same number of ranks")
    if not 0 <= p.node_rank < p.nnodes:
        _reject(f"--node-rank {p.node_rank}: must be in [0, {p.nnodes - 1}] for --nnodes {p.nnodes}")
    if p.nnodes > 1 and not p.dist_init_addr:
        _reject(f"--nnodes {p.nnodes}: give --dist-init-addr host:port (where the nodes' ranks meet)")
    if p.dist_init_addr is not None:
        host, _, port = p.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            _reject(f"--dist-init-addr {p.dist_init_addr}: expected host:port")
        if p.enable_dp_attention and p.nnodes > 1 and int(port) + p.dp_size + 1 > 65535:
            _reject(f"--dist-init-addr {p.dist_init_addr}: DP attention over several nodes takes the "
                    f"{p.dp_size + 1} ports after it (each group's requests, the outputs); choose a lower port")
    if p.dist_timeout is not None and p.dist_timeout <= 0:
        _reject(f"--dist-timeout {p.dist_timeout}: must be > 0")
    if p.base_gpu_id < 0 or (p.base_gpu_id and device.type != "cuda"):
        _reject(f"--base-gpu-id {p.base_gpu_id}: must be >= 0, and picks GPUs only (the device is {device.type})")
    _check_dense_and_head(p, model)
    check_ep(p, model)
    check_tp_shapes(model, p.tp_size, fp8=model.is_fp8 and not load.dequant_fp8,
                    attn_tp=p.tp_size // p.dp_size if p.enable_dp_attention else None,
                    dense_tp=p.moe_dense_tp_size, ep=p.ep_size)
    return replace(p, dist_timeout=p.dist_timeout or DEFAULT_DIST_TIMEOUT)


def _check_dp_attention(p: ParallelConfig) -> None:
    """DP attention (DESIGN.md sec. 6): --dp-size groups of --tp-size / --dp-size ranks. Plain data parallelism
    (whole replicas) does not exist; the combinations not built yet are refused here, in one place."""
    if not p.enable_dp_attention:
        if p.dp_size > 1:
            _reject(f"--dp-size {p.dp_size}: data parallelism here is data-parallel attention; add "
                    "--enable-dp-attention")
        if p.load_balance_method != "shortest_queue":
            _reject(f"--load-balance-method {p.load_balance_method}: acts only with --enable-dp-attention")
        return
    if p.dp_size == 1:
        _reject(f"--enable-dp-attention with --dp-size 1 is plain tensor parallelism; give --dp-size D "
                f"(D divides --tp-size {p.tp_size}, e.g. --dp-size {p.tp_size})")
    if p.tp_size % p.dp_size:
        _reject(f"--tp-size {p.tp_size} --dp-size {p.dp_size}: --dp-size must divide --tp-size "
                "(each DP group runs attention over tp / dp ranks)")


def _check_dense_and_head(p: ParallelConfig, model: ModelConfig) -> None:
    """SGLang's --moe-dense-tp-size (unset or 1: whole dense layers) and --enable-dp-lm-head (this layout)."""
    if p.moe_dense_tp_size is not None:
        if p.moe_dense_tp_size != 1:
            _reject(f"--moe-dense-tp-size {p.moe_dense_tp_size}: only 1 (the dense MLP layers whole on every rank) "
                    "or unset (split like attention)")
        if all(model.is_moe_layer(i) for i in range(model.num_hidden_layers)):
            _reject("--moe-dense-tp-size 1: this model has no dense MLP layers (first_k_dense_replace is 0)")
    if p.enable_dp_lm_head and not p.enable_dp_attention:
        _reject("--enable-dp-lm-head: acts only with --enable-dp-attention (lm_head split within each attention "
                "group)")


def check_tp_shapes(model: ModelConfig, tp: int, fp8: bool, attn_tp: int | None = None,
                    dense_tp: int | None = None, ep: int = 1) -> None:
    """One line naming the first checkpoint tensor that does not split into its shards (of whole 128-blocks
    for block-FP8 weights): `tp` ways, except attention, embedding, lm_head and dense MLPs under DP attention,
    which split `attn_tp` (tp / dp) ways, dense MLPs under --moe-dense-tp-size (`dense_tp`), and routed experts
    under --ep-size (`ep`: tp / ep ways)."""
    a = tp if attn_tp is None else attn_tp
    h, block = model.num_attention_heads, 128
    attn = "model.layers.0.self_attn."
    q = f"{attn}q_proj.weight" if model.q_lora_rank is None else f"{attn}q_b_proj.weight"
    parts = [(q, "heads", h, 0, a), (f"{attn}kv_b_proj.weight", "heads", h, 0, a),
             (f"{attn}o_proj.weight", "heads", h, 0, a), ("model.embed_tokens.weight", "vocab rows", model.vocab_size, 0, a)]
    if fp8:
        parts += [(q, "rows", h * model.qk_head_dim, block, a),
                  (f"{attn}kv_b_proj.weight", "rows", h * (model.qk_nope_head_dim + model.v_head_dim), block, a),
                  (f"{attn}o_proj.weight", "columns", h * model.v_head_dim, block, a)]
    moe = [i for i in range(model.num_hidden_layers) if model.is_moe_layer(i)]
    if len(moe) < model.num_hidden_layers:
        dense = next(i for i in range(model.num_hidden_layers) if not model.is_moe_layer(i))
        parts.append((f"model.layers.{dense}.mlp.down_proj.weight", "columns", model.intermediate_size,
                      block if fp8 else 0, a if dense_tp is None else dense_tp))
    if moe:
        mlp = f"model.layers.{moe[0]}.mlp."
        parts.append((f"{mlp}experts.0.down_proj.weight", "columns", model.moe_intermediate_size, block if fp8 else 0,
                      tp // ep))
        if ep > 1 and model.n_shared_experts:          # each shared expert stays split over all tp ranks
            parts.append((f"{mlp}shared_experts.down_proj.weight", "columns per shared expert",
                          model.moe_intermediate_size, block if fp8 else 0, tp))
    for name, what, n, unit, ways in parts:
        if ways > 1 and (n % ways or (unit and (n // ways) % unit)):
            blocks = f" of whole {unit}-wide blocks (block FP8)" if unit else ""
            flags = f"--tp-size {tp}" + (f" --ep-size {ep}" if "experts" in name and ep > 1 else "") + \
                (f" --dp-size {tp // ways}" if ways == a and a != tp else "")
            _reject(f"{flags}: {name} has {n} {what}, which do not split into {ways} equal parts{blocks}")


def check_ep(p: ParallelConfig, model: ModelConfig) -> None:
    """--ep-size: 1, or ep expert sets of tp / ep ranks, each holding n_routed_experts / ep experts (split along
    the intermediate dimension over its ranks; whole at ep = tp); one line when not."""
    ep = p.ep_size
    if ep < 1:
        _reject(f"--ep-size {ep}: must be >= 1")
    if p.moe_dispatch == "all_to_all":
        if ep == 1:
            _reject("--moe-dispatch all_to_all: needs expert parallelism (--ep-size > 1), whose ranks the rows are "
                    "sent to")
        if not p.enable_dp_attention:
            _reject("--moe-dispatch all_to_all: acts only with --enable-dp-attention (without it every rank holds "
                    "every token and no rows travel)")
    if ep == 1:
        return
    # NOTE: without DP attention every TP rank sees every token, so EP over the TP group needs no dispatch (the
    # all-reduce after the MoE sums the ranks' partial outputs, experts and their intermediate shares alike)
    if p.tp_size % ep:
        _reject(f"--ep-size {ep}: must divide --tp-size {p.tp_size} (expert sets of --tp-size / --ep-size ranks)")
    if not any(model.is_moe_layer(i) for i in range(model.num_hidden_layers + 1)):
        _reject(f"--ep-size {ep}: this model has no routed experts to split")
    if model.n_routed_experts % ep:
        _reject(f"--ep-size {ep}: n_routed_experts ({model.n_routed_experts}) does not split into {ep} equal parts")


def _below(device: DeviceInfo, capability: tuple[int, int]) -> bool:
    return device.capability is not None and device.capability < capability


def _auto_dtype(device: DeviceInfo) -> str:
    if device.type != "cuda":
        return "float32"
    return "float16" if _below(device, (8, 0)) else "bfloat16"


def _resolve_load(load: LoadConfig, model: ModelConfig, device: DeviceInfo) -> LoadConfig:
    if load.device not in ("auto", device.torch_name, device.type):
        raise ValueError(f"device {device.torch_name} was probed for --device {load.device}")
    kernels = load.attention_backend
    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" else "torch"
    if kernels == "triton" and not device.triton:
        _reject("--attention-backend triton: the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)")
    ctx = load.context_length or model.max_position_embeddings
    if not 2 <= ctx <= model.max_position_embeddings:
        _reject(f"--context-length {ctx}: must be in [2, {model.max_position_embeddings}] "
                "(the checkpoint's max_position_embeddings)")
    if load.dequant_fp8 and not model.is_fp8:
        _reject("--dequant-fp8: the checkpoint is not block-FP8 (it has no quantization_config)")
    if model.is_fp8 and not load.dequant_fp8 and kernels == "triton" and _below(device, FP8_E4M3_MIN_CAPABILITY):
        _reject(f"FP8 checkpoint on {device.name} (compute capability {device.capability}): the FP8 kernels "
                "need 8.9 or newer; pass --dequant-fp8 or --attention-backend torch")
    return replace(load, device=device.torch_name, dtype=load.dtype if load.dtype != "auto" else _auto_dtype(device),
                   attention_backend=kernels, context_length=ctx,
                   load_format="safetensors" if load.load_format == "auto" else load.load_format)


def _resolve_kv_dtype(name: str, load: LoadConfig, device: DeviceInfo) -> str:
    if name == "auto":
        return load.dtype
    name = "bfloat16" if name == "bf16" else name
    triton = load.attention_backend == "triton"
    if name == "fp8_e4m3" and triton and _below(device, FP8_E4M3_MIN_CAPABILITY):
        _reject(f"--kv-cache-dtype fp8_e4m3 on compute capability {device.capability}: needs 8.9 or newer "
                "(fp8_e5m2 works)")
    if name not in FP8_KV_DTYPES and name != load.dtype and triton:
        _reject(f"--kv-cache-dtype {name} with --dtype {load.dtype}: the Triton kernels keep the cache in the "
                "activation dtype or FP8 (use auto or fp8_*, or --attention-backend torch)")
    return name


def _resolve_cache(cache: CacheConfig, load: LoadConfig, device: DeviceInfo) -> CacheConfig:
    frac, tokens = cache.mem_fraction_static, cache.max_total_tokens
    if frac is not None and not 0 < frac < 1:
        _reject(f"--mem-fraction-static {frac}: must be in (0, 1)")
    if tokens is not None and tokens < 1:
        _reject(f"--max-total-tokens {tokens}: must be >= 1")
    if device.type != "cuda":
        if frac is not None:
            _reject("--mem-fraction-static sizes the KV pool from GPU memory; on the CPU give --max-total-tokens")
        tokens = tokens or CPU_DEFAULT_TOKENS
    else:
        frac = DEFAULT_MEM_FRACTION if frac is None else frac
    return replace(cache, mem_fraction_static=frac, max_total_tokens=tokens,
                   kv_cache_dtype=_resolve_kv_dtype(cache.kv_cache_dtype, load, device))


def _check_sched_ranges(s: SchedConfig) -> None:
    for name in ("max_running_requests", "max_prefill_tokens", "max_queued_requests", "stream_interval",
                 "decode_log_interval"):
        v = getattr(s, name)
        if v is not None and v < 1:
            _reject(f"{_flag(name)} {v}: must be >= 1")
    if s.chunked_prefill_size == 0 or s.chunked_prefill_size < -1:
        _reject(f"--chunked-prefill-size {s.chunked_prefill_size}: must be >= 1, or -1 to turn chunking off")
    if not 0 <= s.min_new_token_ratio <= s.init_new_token_ratio <= 1:
        _reject(f"--min-new-token-ratio {s.min_new_token_ratio} / --init-new-token-ratio {s.init_new_token_ratio}: "
                "need 0 <= min <= init <= 1")
    if s.watchdog_timeout <= 0:
        _reject(f"--watchdog-timeout {s.watchdog_timeout}: must be > 0")


def _graphs_off_reason(s: SchedConfig, load: LoadConfig, device: DeviceInfo) -> str | None:
    if s.disable_cuda_graph:
        return "--disable-cuda-graph"
    if device.type != "cuda":
        return f"--device {device.type}"
    if load.attention_backend == "torch":
        return "--attention-backend torch"       # the reference attention loops over requests on the host
    if load.disable_mla:
        return "--disable-mla"                   # non-absorbed decode reads lengths on the host
    return None


def _resolve_sched(s: SchedConfig, load: LoadConfig, device: DeviceInfo, cache: CacheConfig) -> SchedConfig:
    _check_sched_ranges(s)
    if s.schedule_policy == "lpm" and cache.disable_radix_cache:
        _reject("--schedule-policy lpm with --disable-radix-cache: lpm orders by cached prefix length, and with the "
                "prefix cache off every request's is 0 (fcfs order); drop one")
    s = replace(s, max_running_requests=s.max_running_requests or DEFAULT_MAX_RUNNING[device.type])
    why_off = _graphs_off_reason(s, load, device)
    if why_off is not None:
        # NOTE: torch.compile runs without graphs where only --disable-cuda-graph turned them off: the padded decode
        # forward of each size, compiled, run eagerly (engine.init_cuda_graphs). Elsewhere the host reads lengths
        # (the PyTorch attention, the non-absorbed decode) or there is no CUDA: compiled steps would recompile
        why_else = _graphs_off_reason(replace(s, disable_cuda_graph=False), load, device)
        eager_compile = why_else is None
        # NOTE: 0 / [] are the resolved "no graphs" values, so resolving twice accepts them
        given = [_flag(n) for n, v in (("cuda_graph_bs", s.cuda_graph_bs), ("cuda_graph_max_bs", s.cuda_graph_max_bs),
                                       ("enable_piecewise_cuda_graph", s.enable_piecewise_cuda_graph),
                                       ("piecewise_cuda_graph_max_tokens", s.piecewise_cuda_graph_max_tokens)) if v]
        if given:
            _reject(f"{' '.join(given)}: these act on CUDA graphs, which are off with {why_off}")
        given = [_flag(n) for n, v in (("enable_torch_compile", s.enable_torch_compile),
                                       ("torch_compile_max_bs", s.torch_compile_max_bs)) if v]
        if given and not eager_compile:
            _reject(f"{' '.join(given)}: torch.compile acts on the CUDA decode path (with or without graphs), which "
                    f"{why_else} rules out")
        compile_bs = _compile_max_bs(s, s.max_running_requests) if eager_compile else 0
        return replace(s, disable_cuda_graph=True, cuda_graph_max_bs=0, cuda_graph_bs=[],
                       torch_compile_max_bs=compile_bs, piecewise_cuda_graph_max_tokens=0)
    sizes, max_bs = _graph_sizes(s)
    return replace(s, cuda_graph_max_bs=max_bs, cuda_graph_bs=sizes, torch_compile_max_bs=_compile_max_bs(s, max_bs),
                   piecewise_cuda_graph_max_tokens=_piecewise_max_tokens(s))


def _compile_max_bs(s: SchedConfig, max_bs: int) -> int:
    """The largest decode batch run through torch.compile (0: off); `max_bs` the largest decode batch it may run."""
    if not s.enable_torch_compile:
        if s.torch_compile_max_bs:
            _reject("--torch-compile-max-bs: acts only with --enable-torch-compile")
        return 0
    compile_bs = s.torch_compile_max_bs or min(DEFAULT_TORCH_COMPILE_MAX_BS, max_bs)
    if compile_bs < 1:
        _reject(f"--torch-compile-max-bs {compile_bs}: must be >= 1")
    return compile_bs


def _piecewise_max_tokens(s: SchedConfig) -> int:
    """The largest extend batch run through piecewise graphs: 0 when they are off (the resolved "off" value)."""
    if not s.enable_piecewise_cuda_graph:
        if s.piecewise_cuda_graph_max_tokens:
            _reject("--piecewise-cuda-graph-max-tokens: acts only with --enable-piecewise-cuda-graph")
        return 0
    n = s.piecewise_cuda_graph_max_tokens if s.piecewise_cuda_graph_max_tokens is not None else \
        DEFAULT_PIECEWISE_MAX_TOKENS
    if n < 1:
        _reject(f"--piecewise-cuda-graph-max-tokens {n}: must be >= 1")
    return n


SPEC_FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
              "speculative_draft_model_path", "speculative_token_map")
MAX_TREE_NODES = 64                        # bits of the int64 tree mask rows (kernels/mla_decode.py)
DEFAULT_SPEC_STEPS = 3                     # DeepSeek's MTP defaults (SGLang's): 3 steps, topk 1, 4 draft tokens


def _resolve_spec(s: SchedConfig, model: ModelConfig, load: LoadConfig) -> SchedConfig:
    """Speculative decoding: the draft is the checkpoint's own MTP layer, or that of the checkpoint
    --speculative-draft-model-path names (checked against the target's config by `draft_checkpoint`), a chain of
    num_steps tokens verified with the token before them (topk 1: num_draft_tokens = num_steps + 1), or a tree
    (topk > 1) of the best num_draft_tokens - 1 of its K + (num_steps - 1) K^2 candidates and the token before them.
    The overlap scheduler stays on: accept lengths stay on the device, and each step's slots are taken for the
    longest advance the step before it may make (`scheduler/decode.spec_columns`)."""
    alg = s.speculative_algorithm
    if alg is None:
        given = [_flag(n) for n in SPEC_FLAGS if getattr(s, n) is not None]
        if given:
            _reject(f"{' '.join(given)}: act only with --speculative-algorithm EAGLE")
        return s
    draft = draft_checkpoint(s.speculative_draft_model_path, load.model_path, model)
    if draft is None and model.num_nextn_predict_layers < 1:
        _reject(f"--speculative-algorithm {alg}: this checkpoint has no MTP (NextN) layer to draft with "
                "(num_nextn_predict_layers is 0 in its config.json); give one with --speculative-draft-model-path")
    steps = s.speculative_num_steps if s.speculative_num_steps is not None else DEFAULT_SPEC_STEPS
    if steps < 1:
        _reject(f"--speculative-num-steps {steps}: must be >= 1")
    topk = s.speculative_eagle_topk if s.speculative_eagle_topk is not None else 1
    drafts = s.speculative_num_draft_tokens if s.speculative_num_draft_tokens is not None else steps + 1
    if topk == 1 and drafts != steps + 1:
        _reject(f"--speculative-num-draft-tokens {drafts}: a chain (topk 1) verifies its {steps} draft tokens and "
                f"the token before them, so it must be {steps + 1} with --speculative-num-steps {steps}")
    if topk > 1:
        _check_tree(steps, topk, drafts)
    elif topk < 1:
        _reject(f"--speculative-eagle-topk {topk}: must be >= 1")
    token_map = s.speculative_token_map
    if token_map is not None and not os.path.isfile(token_map):
        _reject(f"--speculative-token-map {token_map}: no such file")
    if token_map is not None and not token_map.endswith((".pt", ".json")):
        _reject(f"--speculative-token-map {token_map}: expected a .pt or .json file of token ids")
    return replace(s, speculative_algorithm="EAGLE", speculative_num_steps=steps, speculative_eagle_topk=topk,
                   speculative_num_draft_tokens=drafts)


def _check_tree(steps: int, topk: int, drafts: int) -> None:
    """Tree drafts: the verified tokens must fit the candidates and the kernels' 64-bit tree masks."""
    most = 1 + topk + (steps - 1) * topk * topk
    if not 2 <= drafts <= min(most, MAX_TREE_NODES):
        _reject(f"--speculative-num-draft-tokens {drafts}: with --speculative-eagle-topk {topk} and "
                f"--speculative-num-steps {steps} it must be in [2, {min(most, MAX_TREE_NODES)}] (the token before "
                f"the drafts and at most {most - 1} candidates; tree masks hold {MAX_TREE_NODES} tokens)")
    if topk * (steps - 1) > MAX_TREE_NODES:
        _reject(f"--speculative-eagle-topk {topk} x (--speculative-num-steps {steps} - 1): the draft tree's "
                f"{topk * (steps - 1)} nodes exceed the {MAX_TREE_NODES} a tree mask holds")


def _graph_sizes(s: SchedConfig) -> tuple[list[int], int]:
    if s.cuda_graph_bs:
        sizes = sorted(set(s.cuda_graph_bs))
        if sizes[0] < 1:
            _reject(f"--cuda-graph-bs {' '.join(map(str, s.cuda_graph_bs))}: sizes must be >= 1")
        if s.cuda_graph_max_bs and s.cuda_graph_max_bs != sizes[-1]:
            _reject(f"--cuda-graph-max-bs {s.cuda_graph_max_bs} disagrees with the largest --cuda-graph-bs "
                    f"({sizes[-1]}); give one of them")
        return sizes, sizes[-1]
    max_bs = s.cuda_graph_max_bs or min(DEFAULT_CUDA_GRAPH_MAX_BS, s.max_running_requests)
    if max_bs < 1:
        _reject(f"--cuda-graph-max-bs {max_bs}: must be >= 1")
    return default_batch_sizes(max_bs), max_bs


HTTP_ONLY = ("host", "port", "api_key", "chat_template", "tool_call_parser", "reasoning_parser", "enable_metrics",
             "log_requests")
HTTP_ONLY_LOAD = ("served_model_name",)     # the name /v1/models answers; the offline Engine answers no model name


def http_only_flags(server: ServerConfig) -> list[str]:
    """The HTTP-server flags set away from their defaults (they act in `mlaserve serve`, not in the offline Engine)."""
    default = ServerConfig()
    return [_flag(n) for n in HTTP_ONLY if getattr(server, n) != getattr(default, n)] + \
        [_flag(n) for n in HTTP_ONLY_LOAD if getattr(server.load, n) != getattr(default.load, n)]


def precheck(server: ServerConfig, model_path: str) -> ServerConfig:
    """Resolve in the main process before any process starts (device details unprobed: no CUDA context here),
    so a bad combination fails in one line. The scheduler process resolves again against the probed device."""
    p = server.parallel
    if ":" in server.load.device and (p.tp_size > 1 or p.base_gpu_id):
        _reject(f"--device {server.load.device} with --tp-size {p.tp_size} --base-gpu-id {p.base_gpu_id}: each rank "
                "takes its own GPU from --base-gpu-id on; give --device cuda (or auto)")
    device = probe_device(server.load.device, details=False)
    if device.type == "cuda" and ":" not in server.load.device:
        _check_gpu_count(p)
    return resolve_config(server, ModelConfig.from_hf(model_path), device)


def _check_gpu_count(p: ParallelConfig) -> None:
    import torch

    first, last, have = p.base_gpu_id, p.base_gpu_id + p.tp_size // p.nnodes - 1, torch.cuda.device_count()
    if last >= have:
        _reject(f"--tp-size {p.tp_size} --nnodes {p.nnodes} --base-gpu-id {p.base_gpu_id}: this node's ranks need "
                f"GPUs {first}..{last}, and {have} are visible (or pass --device cpu)")


def rank_device(server: ServerConfig, local_rank: int) -> str:
    """The device of the node's `local_rank`-th rank: `--device cuda:N` as given (one rank), else GPU
    base_gpu_id + local_rank, or the CPU."""
    name = server.load.device
    if ":" in name:
        return name
    kind = probe_device(name, details=False).type
    return "cpu" if kind == "cpu" else f"cuda:{server.parallel.base_gpu_id + local_rank}"
