"""The demo model's text: Python source on this machine for training, pip's own source held out.

Training reads every `.py` file of the standard library and the installed packages except pip's directory,
which is the held-out set (pip is in every virtual environment, so CI can measure on it too). Token streams
are documents back to back, each starting with BOS.
"""
from __future__ import annotations

import functools
import importlib.util
import random
import site
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import tokenizers

from mlaserve.tokenizer import BOS

MAX_FILE_BYTES = 1 << 20       # larger .py files are generated tables, not code anyone writes


def heldout_dir() -> Path:
    """pip's package directory (found without importing pip)."""
    spec = importlib.util.find_spec("pip")
    if spec is None or spec.origin is None:
        raise RuntimeError("pip is not installed: the held-out set is pip's source")
    return Path(spec.origin).resolve().parent


def _source_roots() -> list[Path]:
    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    paths += site.getsitepackages()
    roots: list[Path] = []
    for p in map(lambda s: Path(s).resolve(), paths):
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def _py_files(root: Path) -> Iterator[Path]:
    for path in root.rglob("*.py"):
        if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
            yield path


@functools.cache
def training_files() -> tuple[Path, ...]:
    """Every .py file under the stdlib and site-packages directories, pip's directory excluded, sorted."""
    held = heldout_dir()
    files: set[Path] = set()
    for root in _source_roots():
        for path in _py_files(root):
            real = path.resolve()
            if not real.is_relative_to(held):
                files.add(real)
    return tuple(sorted(files))


def heldout_files() -> list[Path]:
    return sorted(p.resolve() for p in _py_files(heldout_dir()))


def read_source(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def read_sources(paths: Iterable[Path], max_bytes: int | None = None) -> list[str]:
    """The UTF-8 texts of `paths` in order (unreadable or empty files skipped), stopping past `max_bytes`."""
    out, size = [], 0
    for path in paths:
        if max_bytes is not None and size >= max_bytes:
            break
        text = read_source(path)
        if text:
            out.append(text)
            size += len(text)
    return out


def sample_texts(texts: list[str], max_bytes: int, seed: int) -> list[str]:
    """A seeded random sample of whole documents, about `max_bytes` of text (the tokenizer's training set)."""
    out, size = [], 0
    for text in shuffled(texts, seed):
        if size >= max_bytes:
            break
        out.append(text)
        size += len(text)
    return out


def shuffled(items: Iterable, seed: int) -> list:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


def token_stream(tok: tokenizers.Tokenizer, texts: list[str], batch: int = 1024) -> np.ndarray:
    """Documents encoded back to back, each led by BOS: uint16 [N] (the vocabulary must fit 16 bits)."""
    assert tok.get_vocab_size() <= 1 << 16, "token ids must fit uint16"
    bos = tok.token_to_id(BOS)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts: list[np.ndarray] = []
    for i in range(0, len(texts), batch):
        for enc in encode(texts[i:i + batch], add_special_tokens=False):
            parts.append(np.asarray([bos, *enc.ids], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def token_bytes(tok: tokenizers.Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for: int64 [V]; 0 for added (special) tokens.

    NOTE: in a byte-level BPE vocabulary each character of a token's string is one byte.
    """
    v = tok.get_vocab_size()
    out = np.zeros(v, dtype=np.int64)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if token not in special:
            out[i] = len(token)
    return out


def windows(stream: np.ndarray, length: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows of `length` tokens from the start of `stream`: [N, length]."""
    n = len(stream) // length
    if max_windows is not None:
        n = min(n, max_windows)
    return stream[: n * length].reshape(n, length)


def heldout_stream(tok: tokenizers.Tokenizer, max_tokens: int | None = None) -> np.ndarray:
    """pip's source, files sorted by path, as one token stream (the first files up to `max_tokens`)."""
    parts, n = [], 0
    for path in heldout_files():
        text = read_source(path)
        if not text:
            continue
        parts.append(token_stream(tok, [text]))
        n += len(parts[-1])
        if max_tokens is not None and n >= max_tokens:
            break
    return np.concatenate(parts)[:max_tokens]


def heldout_windows(tok: tokenizers.Tokenizer, length: int, max_windows: int | None = None) -> np.ndarray:
    """The held-out set as windows of `length` tokens: [N, length]."""
    limit = None if max_windows is None else length * max_windows
    return windows(heldout_stream(tok, limit), length, max_windows)
