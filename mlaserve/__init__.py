"""mlaserve: a serving engine for the DeepSeek model family (MLA + fine-grained MoE, bf16 and block FP8)."""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from mlaserve.server.engine import Engine

        return Engine
    raise AttributeError(name)
