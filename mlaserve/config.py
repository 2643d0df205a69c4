"""Frozen configuration dataclasses; `ModelConfig.from_hf` parses an original DeepSeek `config.json`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """A config.json key or a server flag has a value mlaserve cannot serve (one line naming key or flag)."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (`rope_scaling` with type "yarn"); factor 1 means plain RoPE."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class QuantConfig:
    """Block-wise FP8 (DeepSeek-V3 format): e4m3 weights, float32 `weight_scale_inv` per block."""

    method: str = "fp8"
    fmt: str = "e4m3"
    block: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a DeepSeek V2 / V2-Lite / V3 / R1 checkpoint, with DeepSeek/HF names."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    topk_method: str
    scoring_func: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    quant: QuantConfig | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # --- derived values -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one latent KV-cache row: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale^2 under YaRN (DeepSeek-V2 sec. 2.1, YaRN paper)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim and rs.factor > 1:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def is_fp8(self) -> bool:
        return self.quant is not None

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    # --- parsing --------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | Path) -> "ModelConfig":
        """Parse a checkpoint directory's `config.json` (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"{p}: no config.json found")
        return cls.from_dict(json.loads(p.read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        arch = _architecture(d)
        heads = d["num_attention_heads"]
        if d.get("num_key_value_heads", heads) != heads:
            _bad("num_key_value_heads", d["num_key_value_heads"], f"MLA needs it equal to num_attention_heads ({heads})")
        if d.get("hidden_act", "silu") != "silu":
            _bad("hidden_act", d["hidden_act"], "only silu")
        topk_method = d.get("topk_method", "greedy")
        if topk_method not in TOPK_METHODS:
            _bad("topk_method", topk_method, f"supported: {', '.join(TOPK_METHODS)}")
        scoring = d.get("scoring_func", "softmax")
        if scoring not in SCORING_FUNCS:
            _bad("scoring_func", scoring, f"supported: {', '.join(SCORING_FUNCS)}")
        if topk_method == "noaux_tc" and scoring != "sigmoid":
            _bad("scoring_func", scoring, "noaux_tc routing needs sigmoid")
        n_experts = d.get("n_routed_experts") or 0
        n_group = d.get("n_group") or 1
        if n_experts and n_experts % n_group:
            _bad("n_group", n_group, f"must divide n_routed_experts ({n_experts})")
        cfg = cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            moe_intermediate_size=d.get("moe_intermediate_size") or 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            n_routed_experts=n_experts,
            n_shared_experts=d.get("n_shared_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok") or 0,
            topk_method=topk_method,
            scoring_func=scoring,
            n_group=n_group,
            topk_group=d.get("topk_group") or 1,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=d.get("first_k_dense_replace", 0),
            moe_layer_freq=d.get("moe_layer_freq", 1),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers", 0) or 0,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(d.get("rope_scaling") or d.get("rope_parameters")),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=_eos(d.get("eos_token_id")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            quant=_quant(d.get("quantization_config")),
            raw=dict(d),
        )
        if cfg.n_routed_experts and cfg.topk_group > cfg.n_group:
            _bad("topk_group", cfg.topk_group, f"must be <= n_group ({cfg.n_group})")
        kept = cfg.topk_group * (cfg.n_routed_experts // cfg.n_group)
        if cfg.n_routed_experts and cfg.topk_method != "greedy" and kept < cfg.num_experts_per_tok:
            _bad("topk_group", cfg.topk_group, f"its {kept} experts are fewer than num_experts_per_tok "
                 f"({cfg.num_experts_per_tok})")
        if cfg.n_routed_experts and cfg.num_experts_per_tok > cfg.n_routed_experts:
            _bad("num_experts_per_tok", cfg.num_experts_per_tok, "exceeds n_routed_experts")
        return cfg

    def with_(self, **changes: Any) -> "ModelConfig":
        return replace(self, **changes)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _bad(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"config.json: unsupported {key}={value!r} ({why})")


def _architecture(d: dict) -> str:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    for a in archs:
        if a in SUPPORTED_ARCHS:
            return a
    if not archs and model_type in ("deepseek_v2", "deepseek_v3"):
        return "DeepseekV2ForCausalLM" if model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"
    _bad("architectures", archs or model_type, f"supported: {', '.join(SUPPORTED_ARCHS)}")
    raise AssertionError  # unreachable


def _eos(v: Any) -> int | None:
    return v[0] if isinstance(v, list) and v else v


def _rope_scaling(rs: dict | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("type") or rs.get("rope_type")
    if kind in (None, "default") and "factor" not in rs:
        return None
    if kind not in ("yarn", "deepseek_yarn"):
        _bad("rope_scaling.type", kind, "only yarn")
    known = {f.name for f in fields(RopeScaling)}
    return RopeScaling(**{k: v for k, v in rs.items() if k in known})


def _quant(qc: dict | None) -> QuantConfig | None:
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        _bad("quantization_config.quant_method", method, "only fp8")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        _bad("quantization_config.fmt", fmt, "only e4m3")
    block = tuple(qc.get("weight_block_size") or ())
    if block != (128, 128):
        _bad("quantization_config.weight_block_size", list(block), "only [128, 128]")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        _bad("quantization_config.activation_scheme", scheme, "only dynamic")
    return QuantConfig(method=method, fmt=fmt, block=(128, 128), activation_scheme=scheme)


# --- runtime configuration (the CLI is generated from these fields) ------------------------------

def opt(default: Any = None, help: str = "", **extra: Any) -> Any:
    """A config field with its --help text (and optional `choices`, `nargs`, `aliases`: more flags for it, the
    names SGLang also takes)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class LoadConfig:
    model_path: str | None = opt(None, "checkpoint directory (HF format); default: the built-in demo model",
                                 aliases=("--model",))
    tokenizer_path: str | None = opt(None, "tokenizer directory (default: --model-path)")
    load_format: str = opt("auto", "how to load weights", choices=("auto", "safetensors", "dummy"))
    dtype: str = opt("auto", "activation / weight dtype", choices=("auto", "bfloat16", "float16", "float32"))
    device: str = opt("auto", "cuda, cuda:N, cpu, or auto (cuda when available)")
    context_length: int | None = opt(None, "max tokens per request (default: the model's max_position_embeddings)")
    attention_backend: str = opt("auto", "kernels for the whole model: triton (GPU default) or torch (the PyTorch "
                                 "reference of every op: attention, MoE, norms, FP8 GEMMs, sampling; CPU default)",
                                 choices=("auto", "triton", "torch"))
    disable_mla: bool = opt(False, "run decode in the non-absorbed MLA form too (ablation; no CUDA graphs)")
    dequant_fp8: bool = opt(False, "dequantise a block-FP8 checkpoint to --dtype at load time")
    seed: int = opt(0, "random seed: dummy weights, and the RNG drawing the sampling seed of each request "
                       "without one (same --seed and request order: same sampled outputs)", aliases=("--random-seed",))
    served_model_name: str | None = opt(None, "model name reported by the API (default: the path)")


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = opt(1, "tensor-parallel ranks (one process per GPU, or per CPU rank with gloo)",
                       aliases=("--tp", "--tensor-parallel-size"))
    ep_size: int = opt(1, "expert-parallel size (dividing --tp-size): ep sets of tp / ep ranks, each set holding "
                          "n_routed_experts / ep of the routed experts (whole on each rank when ep = tp)",
                       aliases=("--ep", "--expert-parallel-size"))
    enable_ep_moe: bool = opt(False, "SGLang 0.4's switch for expert parallelism: --ep-size = --tp-size (every "
                                     "rank holds n_routed_experts / tp whole experts)")
    dp_size: int = opt(1, "data-parallel attention groups (with --enable-dp-attention; must divide --tp-size)",
                       aliases=("--dp", "--data-parallel-size"))
    enable_dp_attention: bool = opt(False, "data-parallel attention: --dp-size groups of tp / dp ranks each run "
                                    "attention on their own requests (one latent KV cache, scheduler and radix "
                                    "tree per group); the MoE runs over all ranks")
    moe_dispatch: str = opt("gather", "how DP attention's token rows reach the experts under --ep-size: gather "
                            "(all-gather, every rank's experts over all rows, reduce-scatter: fixed shapes, captured "
                            "in CUDA graphs) or all_to_all (each row only to the ranks holding its experts, and back: "
                            "eager forwards; graph-replayed steps keep the gather; the shared experts are then also "
                            "held whole on every rank)", choices=("gather", "all_to_all"))
    moe_dense_tp_size: int | None = opt(None, "tensor-parallel size of the dense MLP layers (the first "
                                        "first_k_dense_replace): 1 keeps them whole on every rank, with no "
                                        "all-reduce after them; default: split like attention (over the "
                                        "attention group under --enable-dp-attention)")
    enable_dp_lm_head: bool = opt(False, "with --enable-dp-attention: lm_head vocab-parallel within each "
                                  "attention group, no gather across groups (always so here)")
    load_balance_method: str = opt("shortest_queue", "how requests are spread over the DP-attention groups: "
                                   "shortest_queue (fewest running + waiting tokens) or round_robin",
                                   choices=("round_robin", "shortest_queue"))
    base_gpu_id: int = opt(0, "the first GPU this node uses (its ranks take base_gpu_id, base_gpu_id + 1, ...)")
    nnodes: int = opt(1, "nodes the ranks are spread over (--tp-size must be a multiple)")
    node_rank: int = opt(0, "this node's index: node 0 serves HTTP, the others run ranks only")
    dist_init_addr: str | None = opt(None, "host:port where the ranks meet (rank 0's store); required with "
                                     "--nnodes > 1, default a free port on 127.0.0.1")
    dist_timeout: float | None = opt(None, "seconds a collective may wait for the other ranks before the server "
                                     "exits (default: 600)")
    disable_custom_all_reduce: bool = opt(False, "run every tensor-parallel all-reduce on NCCL (default: rows "
                                          "that fit the peer buffers, as decode's do, are summed over CUDA IPC in "
                                          "one launch with the residual add and RMSNorm that follow)")


@dataclass(frozen=True)
class CacheConfig:
    mem_fraction_static: float | None = opt(None, "fraction of GPU memory for weights + KV pool (default: 0.85)")
    max_total_tokens: int | None = opt(None, "KV-pool size in tokens (overrides --mem-fraction-static; "
                                       "default on the CPU: 32768)")
    kv_cache_dtype: str = opt("auto", "latent KV-cache dtype (auto: --dtype); fp8 halves the bytes per token, so "
                              "the same memory holds twice the tokens",
                              choices=("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"))
    disable_radix_cache: bool = opt(False, "turn off prefix caching")


@dataclass(frozen=True)
class SchedConfig:
    max_running_requests: int | None = opt(None, "max requests decoding at once (default: 256 on a GPU, 64 on the CPU)")
    max_queued_requests: int | None = opt(None, "most requests waiting to start in a scheduler (each DP group's "
                                          "own); a request past it ends at once with 503, the queue is full "
                                          "(default: no limit)")
    allow_auto_truncate: bool = opt(False, "keep the first tokens of a prompt too long for the context (or the KV "
                                    "cache) and lower a max_new_tokens that cannot fit to what can, with a "
                                    "warning, instead of answering 400")
    decode_log_interval: int = opt(40, "log a decode batch line (running requests, KV tokens and usage, generation "
                                   "tok/s since the last line, queue) every this many decode steps, and a line per "
                                   "prefill batch, at info level (each DP group's leader)")
    stream_interval: int = opt(1, "send a request's new tokens once this many have come (the first token at once, "
                               "the last ones with its end): fewer, larger stream chunks and output messages")
    max_prefill_tokens: int = opt(16384, "max new tokens in one prefill batch")
    chunked_prefill_size: int = opt(8192, "split prompts longer than this across steps (-1: off)")
    schedule_policy: str = opt("fcfs", "waiting-queue order", choices=("fcfs", "lpm"))
    init_new_token_ratio: float = opt(0.7, "share of max_new_tokens reserved for running requests at first")
    min_new_token_ratio: float = opt(0.1, "floor of that share as it decays")
    disable_overlap_schedule: bool = opt(False, "do CPU scheduling after, not during, the GPU step")
    enable_mixed_chunk: bool = opt(False, "run the requests that are decoding in the same batch as a prefill (or "
                                   "prompt chunk), one token each, instead of pausing them for that step")
    disable_cuda_graph: bool = opt(False, "run decode eagerly (no CUDA graphs; always so on the CPU, with "
                                   "--attention-backend torch and with --disable-mla)")
    cuda_graph_max_bs: int | None = opt(None, "largest decode batch captured in a CUDA graph "
                                        "(default: 160, at most --max-running-requests)")
    cuda_graph_bs: list[int] | None = opt(None, "decode batch sizes to capture (default: a ladder up to "
                                          "--cuda-graph-max-bs)", nargs="+")
    enable_piecewise_cuda_graph: bool = opt(False, "run extend (prefill) batches of up to "
                                            "--piecewise-cuda-graph-max-tokens tokens as CUDA graphs captured "
                                            "between their attention calls (attention runs eagerly between the "
                                            "pieces; a batch is padded to the next captured token count; under "
                                            "DP attention every group pads to the one holding the largest group's)")
    piecewise_cuda_graph_max_tokens: int | None = opt(None, "largest extend batch, in tokens, run through piecewise "
                                                      "CUDA graphs (default: 4096)")
    enable_torch_compile: bool = opt(False, "torch.compile the decode step (inside its CUDA graphs; "
                                     "with --disable-cuda-graph, run eagerly)")
    torch_compile_max_bs: int | None = opt(None, "largest decode batch run through torch.compile (default: 32)",
                                           aliases=("--max-torch-compile-bs",))
    watchdog_timeout: float = opt(300.0, "seconds a single step may take before the server exits")
    skip_server_warmup: bool = opt(False, "report ready without the warm-up requests (a prompt, then the same prompt "
                                   "as a prefix-cache hit, and on a GPU one prompt each of 200 to 8000 tokens, so "
                                   "the first user requests do not pay for the kernels compiled on first use)")
    speculative_algorithm: str | None = opt(None, "speculative decoding: EAGLE drafts with an MTP (NextN) layer (the "
                                           "checkpoint's own, or --speculative-draft-model-path's) and verifies the "
                                           "drafts in one target forward; NEXTN is the same",
                                           choices=("EAGLE", "NEXTN"))
    speculative_num_steps: int | None = opt(None, "draft steps per verification (default: 3)")
    speculative_eagle_topk: int | None = opt(None, "draft branches per step (default: 1, a chain)")
    speculative_num_draft_tokens: int | None = opt(None, "tokens verified per step (default: num_steps + 1)")
    speculative_draft_model_path: str | None = opt(None, "checkpoint whose MTP layer drafts (default: --model-path's "
                                                   "own): SGLang's NextN format (`mlaserve export-nextn` writes it; "
                                                   "without its own embedding / head it uses the target's) or any "
                                                   "checkpoint of the target's shapes with an MTP layer; the target "
                                                   "then needs none")
    speculative_token_map: str | None = opt(None, "a .pt (or .json) list of token ids the draft head keeps: each draft "
                                            "step reads those rows of the output head instead of the whole vocabulary "
                                            "(outputs are unchanged; drafts outside the list are never proposed; "
                                            "`mlaserve token-map` counts a corpus to make one)")
    grammar_backend: str = opt("xgrammar", "structured output (json_schema / regex / ebnf / response_format / "
                               "forced tool calls): xgrammar, or none to refuse such requests (400)",
                               choices=("xgrammar", "none"))


@dataclass(frozen=True)
class ServerConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    host: str = opt("127.0.0.1", "HTTP host")
    port: int = opt(30000, "HTTP port")
    api_key: str | None = opt(None, "require this bearer token")
    chat_template: str | None = opt(None, "jinja chat template file (default: the tokenizer's)")
    tool_call_parser: str | None = opt(None, "tool-call format", choices=("deepseekv3", "deepseekv31"))
    reasoning_parser: str | None = opt(None, "split reasoning from content", choices=("deepseek-r1", "deepseek-v3"))
    enable_metrics: bool = opt(False, "expose Prometheus metrics at /metrics")
    log_level: str = opt("info", "logging level", choices=("debug", "info", "warning", "error"))
    log_requests: bool = opt(False, "log every request")

    SECTIONS = ("load", "parallel", "cache", "sched")

    @classmethod
    def from_flat(cls, **kwargs: Any) -> "ServerConfig":
        """Build from flat keyword arguments (`model_path=..., tp_size=..., port=...`) as the Engine API takes."""
        parts: dict[str, dict] = {s: {} for s in cls.SECTIONS}
        top: dict[str, Any] = {}
        owners = {f.name: s for s in cls.SECTIONS for f in fields(_SECTION_TYPES[s])}
        own = {f.name for f in fields(cls)} - set(cls.SECTIONS)
        for k, v in kwargs.items():
            k = FIELD_ALIASES.get(k, k)
            if k in owners:
                parts[owners[k]][k] = v
            elif k in own:
                top[k] = v
            elif k in REFUSED_FLAGS:
                raise TypeError(f"{k}: {REFUSED_FLAGS[k][1]}")
            else:
                raise TypeError(f"unknown server argument {k!r}")
        return cls(**{s: _SECTION_TYPES[s](**parts[s]) for s in cls.SECTIONS}, **top)

    def flat(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.SECTIONS}
        for s in self.SECTIONS:
            sec = getattr(self, s)
            out |= {f.name: getattr(sec, f.name) for f in fields(sec)}
        return out


_SECTION_TYPES = {"load": LoadConfig, "parallel": ParallelConfig, "cache": CacheConfig, "sched": SchedConfig}


# --- the command line, generated from the fields above --------------------------------------------

_SECTION_TITLES = {"load": "model loading", "parallel": "parallelism", "cache": "KV cache", "sched": "scheduling"}


def add_config_args(parser: Any, cls: type = ServerConfig) -> None:
    """Add one `--kebab-case` flag per field of `cls`, its sections flattened (`--model-path`, `--tp-size`),
    grouped in `--help` by section; help, `choices` and `nargs` come from the field's metadata."""
    for section in cls.SECTIONS:
        group = parser.add_argument_group(_SECTION_TITLES.get(section, section))
        for f in fields(_SECTION_TYPES[section]):
            _add_flag(group, f, _SECTION_TYPES[section])
    group = parser.add_argument_group("server")
    for f in fields(cls):
        if f.name not in cls.SECTIONS:
            _add_flag(group, f, cls)
    add_refused_flags(parser)


def add_refused_flags(parser: Any) -> None:
    """`REFUSED_FLAGS` on `parser`: hidden from --help, each an error line saying why where given."""
    import argparse

    class Refused(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string}: {REFUSED_FLAGS[self.dest][1]}")

    for name, (nargs, _) in REFUSED_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), nargs=nargs, help=argparse.SUPPRESS, action=Refused)


# SGLang's ServerArgs field names (its Engine API's keywords) where ours differ
FIELD_ALIASES = {"random_seed": "seed"}

# SGLang flags that its users' commands carry (the seeds' launch lines) and mlaserve does not take: each gets one
# line saying why, instead of argparse's "unrecognized arguments" (name -> (nargs, why))
REFUSED_FLAGS = {
    "trust_remote_code": (0, "mlaserve runs no code from the model folder (the DeepSeek architectures and the "
                             "tokenizer.json reader are built in); drop the flag"),
    "enable_flashinfer_mla": (0, "mlaserve's MLA runs on its own Triton kernels (--attention-backend triton, the "
                                 "GPU default); drop the flag"),
    "quantization": ("?", "mlaserve takes block FP8 from the checkpoint's quantization_config (as DeepSeek-V3 / R1 "
                          "ship) and does not quantize a bf16 checkpoint while loading (do it once: python -m "
                          "mlaserve.tools.quantize_fp8 SRC DST); drop the flag"),
}


def config_from_args(ns: Any, cls: type = ServerConfig) -> ServerConfig:
    """The config from a namespace parsed with `add_config_args`."""
    names = [f.name for s in cls.SECTIONS for f in fields(_SECTION_TYPES[s])]
    names += [f.name for f in fields(cls) if f.name not in cls.SECTIONS]
    return cls.from_flat(**{n: getattr(ns, n) for n in names})


def _add_flag(group: Any, f: Any, owner: type) -> None:
    import argparse
    import typing

    flag = "--" + f.name.replace("_", "-")
    kind = typing.get_type_hints(owner)[f.name]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if args else kind
    help_ = f.metadata.get("help", "")
    if base is bool:
        action = argparse.BooleanOptionalAction if f.default else "store_true"
        group.add_argument(flag, *f.metadata.get("aliases", ()), action=action, default=f.default, help=help_)
        return
    nargs = f.metadata.get("nargs")
    if typing.get_origin(base) is list:
        base = typing.get_args(base)[0]
    if f.default is not None and "default" not in help_:
        help_ += " (default: %(default)s)"
    metavar = {int: "N", float: "X"}.get(base, f.name.split("_")[-1].upper())
    group.add_argument(flag, *f.metadata.get("aliases", ()), type=base, default=f.default,
                       choices=f.metadata.get("choices"), nargs=nargs,
                       metavar=None if f.metadata.get("choices") else metavar, help=help_)
