"""`--speculative-draft-model-path`: a draft checkpoint apart from the target's, checked against the target's
config.json (one line naming the field), and where its MTP (NextN) layer's tensors are."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlaserve.config import ConfigError, ModelConfig, QuantConfig

NEXTN_ARCH = "DeepseekV3ForCausalLMNextN"   # SGLang's export of the MTP layer alone, as model.layers.0
# ModelConfig fields that fix the MTP layer's tensors and what it computes: a draft's must equal the target's
SAME_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
               "n_shared_experts", "num_experts_per_tok", "topk_method", "scoring_func", "n_group", "topk_group",
               "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq", "rms_norm_eps",
               "rope_theta", "rope_scaling", "attention_bias", "quant")


@dataclass(frozen=True)
class DraftCheckpoint:
    """A draft checkpoint directory and the prefix of its MTP layer's tensor names: `model.layers.0.` in the NextN
    format, `model.layers.{num_hidden_layers}.` in a full checkpoint (whose other tensors are not read)."""

    path: str
    prefix: str
    nextn: bool

    def to_target(self, name: str, mtp_prefix: str) -> str | None:
        """The target's name for the draft's tensor `name` (its MTP layer at `mtp_prefix`); None outside the layer."""
        return mtp_prefix + name[len(self.prefix):] if name.startswith(self.prefix) else None

    def to_draft(self, name: str, mtp_prefix: str) -> str:
        """The draft checkpoint's name for the target's MTP tensor `name`."""
        return self.prefix + name[len(mtp_prefix):]


def draft_checkpoint(path: str | None, model_path: str | None, target: ModelConfig) -> DraftCheckpoint | None:
    """The checkpoint `--speculative-draft-model-path` names, checked against the target's config; None when the
    flag is unset or names the target's own directory (its MTP layer drafts). Accepts SGLang's NextN export
    (`DeepseekV3ForCausalLMNextN`, the layer as `model.layers.0`) and any checkpoint with an MTP layer; raises
    ConfigError (one line) for one that cannot draft for `target`."""
    if path is None or (model_path is not None and os.path.realpath(path) == os.path.realpath(model_path)):
        return None
    flag = f"--speculative-draft-model-path {path}"
    d = _read_config(Path(path), flag)
    nextn = NEXTN_ARCH in (d.get("architectures") or [])
    try:
        cfg = ModelConfig.from_dict((d | {"architectures": ["DeepseekV3ForCausalLM"]}) if nextn else d)
    except KeyError as e:
        raise ConfigError(f"{flag}: config.json has no key {e}") from None
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{flag}: {e}") from None
    if not nextn and cfg.num_nextn_predict_layers < 1:
        raise ConfigError(f"{flag}: this checkpoint has no MTP (NextN) layer to draft with (num_nextn_predict_layers "
                          f"is 0 in its config.json and its architectures are not {NEXTN_ARCH})")
    # NOTE: a full checkpoint's MTP layer index (and so whether it is MoE) follows its num_hidden_layers
    for name in SAME_FIELDS + (() if nextn else ("num_hidden_layers",)):
        mine, theirs = getattr(cfg, name), getattr(target, name)
        if mine != theirs:
            key = "quantization_config" if name == "quant" else name
            raise ConfigError(f"{flag}: {key} is {_show(mine)} in its config.json and {_show(theirs)} in the "
                              "target's (the draft's layer must have the target's shapes)")
    prefix = "model.layers.0." if nextn else f"model.layers.{cfg.num_hidden_layers}."
    return DraftCheckpoint(path, prefix, nextn)


def _read_config(path: Path, flag: str) -> dict:
    if not path.is_dir():
        raise ConfigError(f"{flag}: no such directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag}: no config.json in the directory")
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag}: cannot read config.json ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: config.json is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{flag}: config.json is not a JSON object")
    return d


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, QuantConfig):
        return f"{value.method} {value.fmt} blocks {list(value.block)}"
    return repr(value) if isinstance(value, str) else str(value)
