"""DeepSeek checkpoint names, shapes and dtypes; loading sharded safetensors one tensor at a time; dummy weights.

`checkpoint_specs(cfg)` is the one definition of the original checkpoint layout: make-checkpoint writes it,
the loader checks against it, `--load-format dummy` generates it.
"""
from __future__ import annotations

import itertools
import json
import logging
import pickle
import re
import zlib
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
from tqdm import tqdm

from mlaserve.config import ModelConfig
from mlaserve.draft_checkpoint import DraftCheckpoint
from mlaserve.kernels.quant import block_dequant_ref, block_quant_fp8_ref
from mlaserve.layers.linear import cdiv, copy_checked

logger = logging.getLogger(__name__)

# kinds: "linear" (FP8 in FP8 checkpoints), "dense" (a bf16 matrix: embeddings, router, heads, eh_proj),
# "norm", "bias" (float32 e_score_correction_bias), "scale" (float32 weight_scale_inv)


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class CheckpointError(ValueError):
    """The checkpoint does not match config.json (the message names the tensor)."""


def _attn_specs(cfg: ModelConfig, p: str) -> Iterator[TensorSpec]:
    h, hid = cfg.num_attention_heads, cfg.hidden_size
    if cfg.q_lora_rank is None:
        yield TensorSpec(f"{p}self_attn.q_proj.weight", (h * cfg.qk_head_dim, hid), "linear")
    else:
        yield TensorSpec(f"{p}self_attn.q_a_proj.weight", (cfg.q_lora_rank, hid), "linear")
        yield TensorSpec(f"{p}self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,), "norm")
        yield TensorSpec(f"{p}self_attn.q_b_proj.weight", (h * cfg.qk_head_dim, cfg.q_lora_rank), "linear")
    yield TensorSpec(f"{p}self_attn.kv_a_proj_with_mqa.weight", (cfg.kv_cache_dim, hid), "linear")
    yield TensorSpec(f"{p}self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,), "norm")
    yield TensorSpec(f"{p}self_attn.kv_b_proj.weight",
                     (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "linear")
    yield TensorSpec(f"{p}self_attn.o_proj.weight", (hid, h * cfg.v_head_dim), "linear")


def _mlp_specs(p: str, hid: int, inter: int) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{p}gate_proj.weight", (inter, hid), "linear")
    yield TensorSpec(f"{p}up_proj.weight", (inter, hid), "linear")
    yield TensorSpec(f"{p}down_proj.weight", (hid, inter), "linear")


def _layer_specs(cfg: ModelConfig, i: int) -> Iterator[TensorSpec]:
    p, hid = f"model.layers.{i}.", cfg.hidden_size
    yield TensorSpec(f"{p}input_layernorm.weight", (hid,), "norm")
    yield from _attn_specs(cfg, p)
    yield TensorSpec(f"{p}post_attention_layernorm.weight", (hid,), "norm")
    if not cfg.is_moe_layer(i):
        yield from _mlp_specs(f"{p}mlp.", hid, cfg.intermediate_size)
        return
    yield TensorSpec(f"{p}mlp.gate.weight", (cfg.n_routed_experts, hid), "dense")
    if cfg.topk_method == "noaux_tc":
        yield TensorSpec(f"{p}mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), "bias")
    for j in range(cfg.n_routed_experts):
        yield from _mlp_specs(f"{p}mlp.experts.{j}.", hid, cfg.moe_intermediate_size)
    if cfg.n_shared_experts:
        yield from _mlp_specs(f"{p}mlp.shared_experts.", hid, cfg.moe_intermediate_size * cfg.n_shared_experts)


def _mtp_specs(cfg: ModelConfig) -> Iterator[TensorSpec]:
    n, hid, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    p = f"model.layers.{n}."
    yield TensorSpec(f"{p}embed_tokens.weight", (v, hid), "dense")   # a copy of the shared embedding
    yield TensorSpec(f"{p}enorm.weight", (hid,), "norm")
    yield TensorSpec(f"{p}hnorm.weight", (hid,), "norm")
    yield TensorSpec(f"{p}eh_proj.weight", (hid, 2 * hid), "dense")
    yield from _layer_specs(cfg, n)
    yield TensorSpec(f"{p}shared_head.norm.weight", (hid,), "norm")
    yield TensorSpec(f"{p}shared_head.head.weight", (v, hid), "dense")


def checkpoint_specs(cfg: ModelConfig, include_mtp: bool = True) -> list[TensorSpec]:
    """Every tensor of the original checkpoint, in file order, FP8 scales after their weights."""
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "dense")]
    for i in range(cfg.num_hidden_layers):
        specs.extend(_layer_specs(cfg, i))
    specs.append(TensorSpec("model.norm.weight", (cfg.hidden_size,), "norm"))
    specs.append(TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "dense"))
    if include_mtp and cfg.num_nextn_predict_layers:
        specs.extend(_mtp_specs(cfg))
    if cfg.quant is None:
        return specs
    bn, bk = cfg.quant.block
    out: list[TensorSpec] = []
    for s in specs:
        out.append(s)
        if s.kind == "linear":
            out.append(TensorSpec(s.name + "_scale_inv", (cdiv(s.shape[0], bn), cdiv(s.shape[1], bk)), "scale"))
    return out


def spec_dtype(spec: TensorSpec, cfg: ModelConfig) -> torch.dtype:
    if spec.kind in ("bias", "scale"):
        return torch.float32
    if spec.kind == "linear" and cfg.quant is not None:
        return torch.float8_e4m3fn
    return torch.bfloat16


# --- synthetic values ---------------------------------------------------------------------------

LOGIT_STD = 4.0   # lm_head scale: logits ~ N(0, 4^2), so greedy picks are far from ties


def synthetic_tensor(spec: TensorSpec, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Random float32 values for `spec`, reproducible per (seed, name), scaled to keep activations O(1).

    Matrices get std 1/sqrt(fan_in) (the heads 4/sqrt(fan_in), the embedding 1), norms 1 + N(0, 0.1^2),
    the noaux_tc bias N(0, 0.05^2).
    """
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**63)
    x = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32)
    if spec.kind == "norm":
        return 1.0 + 0.1 * x
    if spec.kind == "bias":
        return 0.05 * x
    if spec.name.endswith("embed_tokens.weight"):
        return x
    gain = LOGIT_STD if spec.name.endswith(("lm_head.weight", "shared_head.head.weight")) else 1.0
    return x * (gain / spec.shape[1] ** 0.5)


def synthetic_checkpoint(cfg: ModelConfig, seed: int, specs: list[TensorSpec] | None = None,
                         device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in checkpoint dtypes; FP8 linears are block-quantised with their scale_inv following."""
    specs = specs if specs is not None else checkpoint_specs(cfg)
    embed = None
    for spec in specs:
        if spec.kind == "scale":
            continue
        if spec.name.startswith(f"model.layers.{cfg.num_hidden_layers}.embed_tokens"):
            yield spec.name, embed.clone() if embed is not None else synthetic_tensor(
                TensorSpec("model.embed_tokens.weight", spec.shape, "dense"), seed, device).to(torch.bfloat16)
            continue
        x = synthetic_tensor(spec, seed, device)
        if spec.kind == "linear" and cfg.quant is not None:
            w_q, s = block_quant_fp8_ref(x, cfg.quant.block)
            yield spec.name, w_q
            yield spec.name + "_scale_inv", s
            continue
        x = x.to(spec_dtype(spec, cfg))
        if spec.name == "model.embed_tokens.weight":
            embed = x
        yield spec.name, x


# --- loading ------------------------------------------------------------------------------------

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")


_SHARED = re.compile(r"^(.*\.mlp)\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_QKV_A = re.compile(r"^(.*\.self_attn)\.(q_a_proj|q_proj|kv_a_proj_with_mqa)\.weight(_scale_inv)?$")
_STACKED = re.compile(r"^(.*\.mlp(?:\.shared_experts)?)\.(gate_proj|up_proj)\.weight(_scale_inv)?$")


def iter_safetensors(path: str | Path, skip=None) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """(tensor count, iterator of (name, tensor)) over a checkpoint directory, shard by shard via the index.
    Names for which `skip(name)` is true are neither read nor counted."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors.index.json or model.safetensors")
    handles = [safe_open(str(path / f), framework="pt") for f in files]
    wanted = [(h, name) for h in handles for name in h.keys() if skip is None or not skip(name)]

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for h, name in wanted:
            yield name, h.get_tensor(name)
    return len(wanted), gen()


class WeightLoader:
    """Routes checkpoint tensors to the model's parameters by original name, checking each against its spec.
    With a separate `draft` checkpoint the MTP layer's tensors come from it (renamed to the target's MTP index),
    and the target's own are not read."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, *, dequant_fp8: bool,
                 draft: DraftCheckpoint | None = None):
        self.model, self.cfg, self.dequant, self.draft = model, cfg, dequant_fp8, draft
        has_mtp = getattr(model, "mtp", None) is not None
        assert draft is None or has_mtp, "a draft checkpoint for a model built without its MTP layer"
        self.specs = {s.name: s for s in checkpoint_specs(cfg, include_mtp=has_mtp)}
        self.all_names = {s.name for s in checkpoint_specs(cfg, include_mtp=True)}
        self.params = dict(model.named_parameters())
        self.seen: set[str] = set()
        self.pending: dict[str, torch.Tensor] = {}   # fp8 weight or scale awaiting its partner (dequant)
        self.mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
        self.skipped = 0                             # other EP ranks' expert tensors, counted as seen, not read

    def param_name(self, name: str) -> str:
        if name.startswith(self.mtp_prefix):
            rest = name[len(self.mtp_prefix):]
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.")):
                return "mtp." + rest
            return "mtp.block." + rest
        return name

    def skip(self, name: str) -> bool:
        """True for a tensor this model does not hold, so the loader need not read it: a routed expert another EP
        rank holds (counted as loaded) or the MTP layer of a model built without it."""
        if name not in self.specs:
            return name in self.all_names
        m = _EXPERT.match(name)
        if m is None:
            return False
        if self.model.get_submodule(self.param_name(m.group(1) + ".")[:-1]).holds(int(m.group(2))):
            return False
        self.seen.add(name)
        self.skipped += 1
        return True

    def read(self, path: str | Path) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(tensor count, (name, tensor)) of the checkpoint at `path`, then of the separate draft's MTP layer under
        the target's names: the target's own MTP tensors and a full draft checkpoint's other ones are not read."""
        if self.draft is None:
            return iter_safetensors(path, skip=self.skip)
        n, items = iter_safetensors(path, skip=lambda name: name.startswith(self.mtp_prefix) or self.skip(name))
        m, drafts = iter_safetensors(self.draft.path, skip=self._skip_draft)
        return n + m, itertools.chain(items, ((self.draft.to_target(k, self.mtp_prefix), t) for k, t in drafts))

    def _skip_draft(self, name: str) -> bool:
        """`skip` for the draft checkpoint's names; raises on a NextN checkpoint's tensor outside model.layers.0."""
        target = self.draft.to_target(name, self.mtp_prefix)
        if target is not None:
            return self.skip(target)
        if self.draft.nextn:
            raise CheckpointError(f"unexpected tensor {name!r} in the NextN draft checkpoint {self.draft.path} "
                                  f"(it holds {self.draft.prefix}* only)")
        return True

    def where(self, name: str, quote: bool = True) -> str:
        """`name` as its file has it (for messages): a separate draft's MTP tensors by the draft's names."""
        if self.draft is not None and name.startswith(self.mtp_prefix):
            own = self.draft.to_draft(name, self.mtp_prefix)
            return f"{repr(own) if quote else own} of the draft checkpoint {self.draft.path}"
        return repr(name) if quote else name

    def load(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None:
            if name in self.all_names:          # MTP weights of a model built without the MTP layer
                return
            raise CheckpointError(f"unexpected tensor {self.where(name)} (shape {list(tensor.shape)}) for this "
                                  "config.json")
        if tuple(tensor.shape) != spec.shape:
            raise CheckpointError(f"{self.where(name, quote=False)}: shape {list(tensor.shape)}, "
                                  f"expected {list(spec.shape)}")
        if self.skip(name):
            return                               # another EP rank's expert
        self.seen.add(name)
        if name == f"{self.mtp_prefix}embed_tokens.weight":
            return                               # the MTP layer shares model.embed_tokens
        if self.dequant and self.cfg.quant is not None and spec.kind in ("linear", "scale"):
            self._pair_and_dequant(name, tensor, spec)
            return
        self._route(name, tensor)

    def _pair_and_dequant(self, name: str, tensor: torch.Tensor, spec: TensorSpec) -> None:
        w_name = name[: -len("_scale_inv")] if spec.kind == "scale" else name
        partner = name + "_scale_inv" if spec.kind == "linear" else w_name
        if partner not in self.pending:
            self.pending[name] = tensor
            return
        other = self.pending.pop(partner)
        w, s = (tensor, other) if spec.kind == "linear" else (other, tensor)
        self._route(w_name, block_dequant_ref(w, s, self.cfg.quant.block, torch.float32))

    def _route(self, name: str, tensor: torch.Tensor) -> None:
        m = _SHARED.match(name)
        if m:
            experts = self.model.get_submodule(self.param_name(m.group(1) + ".")[:-1] + ".experts")
            experts.load_shared(name, m.group(2), tensor, scale=m.group(3) is not None)
            return
        m = _QKV_A.match(name)
        if m:
            attn = self.model.get_submodule(self.param_name(m.group(1) + ".")[:-1])
            if attn.qkv_a_proj is not None:                   # q_a_proj / q_proj and kv_a_proj_with_mqa as one GEMM
                attn.qkv_a_proj.load_part(name, int(m.group(2) == "kv_a_proj_with_mqa"), tensor,
                                          scale=m.group(3) is not None)
                return
        m = _STACKED.match(name)
        if m:
            module = self.model.get_submodule(self.param_name(m.group(1) + ".")[:-1] + ".gate_up_proj")
            module.load_part(name, 0 if m.group(2) == "gate_proj" else 1, tensor, scale=m.group(3) is not None)
            return
        m = _EXPERT.match(name)
        if m:
            experts = self.model.get_submodule(self.param_name(m.group(1) + ".")[:-1])
            experts.load_expert(name, int(m.group(2)), m.group(3), tensor, scale=m.group(4) is not None)
            return
        pname = self.param_name(name)
        param = self.params.get(pname)
        if param is None:
            raise CheckpointError(f"{name}: no parameter {pname!r} in the model")
        getattr(param, "weight_loader", copy_checked)(name, param, tensor)

    def finish(self) -> None:
        if self.draft is not None:
            self._share_with_target()
        missing = [n for n in self.specs if n not in self.seen]
        if missing:
            raise CheckpointError(f"missing tensor {self.where(missing[0])} (expected shape "
                                  f"{list(self.specs[missing[0]].shape)})"
                                  + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        if self.pending:
            raise CheckpointError(f"FP8 tensor {self.where(next(iter(self.pending)))} has no weight/scale partner")
        post_load(self.model)

    def _share_with_target(self) -> None:
        """A separate draft may leave out its copies of the embedding and output head (newer NextN exports do): the
        MTP layer shares model.embed_tokens anyway, and then shares lm_head's weight as its head."""
        embed, head = self.mtp_prefix + "embed_tokens.weight", self.mtp_prefix + "shared_head.head.weight"
        self.seen.add(embed)
        if head not in self.seen:
            self.model.mtp.shared_head.head.weight = self.model.lm_head.weight
            self.seen.add(head)


def post_load(model: torch.nn.Module) -> None:
    """Weights derived from loaded ones: absorbed w_kc / w_vc (MLA), the fp32 router weight."""
    for mod in model.modules():
        if hasattr(mod, "post_load"):
            mod.post_load()


def load_weights(model: torch.nn.Module, cfg: ModelConfig, path: str | Path | None, *,
                 load_format: str = "auto", dequant_fp8: bool = False, seed: int = 0,
                 progress: bool = True, draft: DraftCheckpoint | None = None) -> None:
    """Fill `model` from a checkpoint directory (`auto`/`safetensors`) or with random values (`dummy`, the MTP
    layer too); `draft`: the separate checkpoint the MTP layer's weights come from (`cfg` then has an MTP layer)."""
    loader = WeightLoader(model, cfg, dequant_fp8=dequant_fp8, draft=draft)
    device = next(model.parameters()).device
    if load_format == "dummy":
        specs = [s for s in loader.specs.values() if not loader.skip(s.name)]
        total, items = len(specs), synthetic_checkpoint(cfg, seed, specs, device)
    elif load_format in ("auto", "safetensors"):
        if path is None:
            raise CheckpointError("no checkpoint path given")
        total, items = loader.read(path)
    else:
        raise ValueError(f"unknown load format {load_format!r}; choices: auto, safetensors, dummy")
    for name, tensor in tqdm(items, total=total, desc="loading weights", unit="tensor",
                             disable=not progress, leave=False):
        loader.load(name, tensor.to(device))
    loader.finish()
    if loader.skipped:
        logger.info("weights: %d tensors of other expert-parallel ranks' experts not read", loader.skipped)


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """`--speculative-token-map`: the token ids the draft head keeps, sorted and unique (int64 [V']). The file is a
    `.pt` holding a 1-D integer tensor or a list of ids (SGLang's format; `mlaserve token-map` writes one) or a
    `.json` list of ids. ValueError naming the flag on anything else."""
    path = Path(path)
    flag = f"--speculative-token-map {path}"
    try:
        if path.suffix == ".json":
            raw = json.loads(path.read_text())
        elif path.suffix == ".pt":
            raw = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise ValueError(f"{flag}: expected a .pt or .json file of token ids")
        ids = torch.as_tensor(raw)
    except (OSError, RuntimeError, TypeError, json.JSONDecodeError, pickle.UnpicklingError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{flag}: cannot read token ids: {first}") from None
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{flag}: expected a non-empty 1-D list of integer token ids, got {tuple(ids.shape)} "
                         f"{ids.dtype}")
    ids = ids.to(torch.int64).unique()                       # sorted
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"{flag}: token ids must be in [0, {vocab_size}) for this checkpoint; the file has "
                         f"{int(ids[0])} .. {int(ids[-1])}")
    return ids
