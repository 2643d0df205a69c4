"""Tokenizer for serving: encode, decode and the chat template of a checkpoint's `tokenizer.json` directory.

Runtime needs only `tokenizers` and `jinja2` (transformers is a test dependency). Streaming lives in `detokenize`.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"

# NOTE: the order is the id order of tokenizers trained by mlaserve.tools.tokenizer (ids 0..15).
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS, EOS, PAD, USER, ASSISTANT, THINK_BEGIN, THINK_END,
    TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP,
    TOOL_OUTPUTS_BEGIN, TOOL_OUTPUTS_END, TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END,
)
# Only these are dropped by `skip_special_tokens`; the rest stay in text because the
# reasoning and tool-call parsers read them (they are "special": false added tokens).
SKIPPED_TOKENS: tuple[str, ...] = (BOS, EOS, PAD)

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def default_chat_template() -> str:
    """The DeepSeek-V3 chat template shipped with mlaserve (package data)."""
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with the special tokens and chat template of a checkpoint.

    `encode(text, add_bos=True)` equals HF `AutoTokenizer(...).encode(text)` for DeepSeek tokenizers:
    BOS is prepended here, never by the backend's post-processor, so it appears exactly once.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str | None,
        eos_token: str | None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template if chat_template is not None else default_chat_template()

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (HF `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters one token stands for (None: unknown, as a normalizer may change the text)."""
        if self.backend.normalizer is not None:
            return None
        return max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))

    def min_tokens(self, text: str) -> int:
        """A lower bound of len(encode(text, add_bos=False)), found without tokenizing (0: none known)."""
        most = self.max_token_chars
        return -(-len(text) // most) if most else 0

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        return [bos, *ids] if add_bos and bos is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render `messages` (OpenAI-style dicts) to the prompt string; BOS is part of it.

        Same output as HF `apply_chat_template(messages, tools=tools, tokenize=False, ...)`.
        """
        return self._template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt ids of a chat: the rendered template already starts with BOS, so none is added."""
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt), add_bos=False)

    @cached_property
    def _template(self) -> Any:
        return compile_chat_template(self.chat_template)


def compile_chat_template(source: str) -> Any:
    """Compile a chat template in the same sandboxed jinja environment HF transformers uses
    (trim/lstrip blocks, loop controls, non-escaping `tojson`, `raise_exception`, `strftime_now`)."""
    # lazy: jinja2 costs more to import than tokenizers, and only chat requests need it
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` (+ `tokenizer_config.json` when present) from a checkpoint directory.

    The chat template comes from `tokenizer_config.json`, else `chat_template.jinja` in the directory,
    else the DeepSeek-V3 template shipped with mlaserve.
    """
    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    return Tokenizer(
        tokenizers.Tokenizer.from_file(str(tok_file)),
        bos_token=_token_content(cfg.get("bos_token")),
        eos_token=_token_content(cfg.get("eos_token")),
        pad_token=_token_content(cfg.get("pad_token")),
        chat_template=_find_chat_template(path, cfg),
    )


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json stores a token either as a string or as {"content": ..., ...}
    return value.get("content") if isinstance(value, dict) else value


def _find_chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    return template


__all__ = [
    "BOS", "EOS", "PAD", "SKIPPED_TOKENS", "SPECIAL_TOKENS", "Tokenizer",
    "compile_chat_template", "default_chat_template", "load_tokenizer",
]
