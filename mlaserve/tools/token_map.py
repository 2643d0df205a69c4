"""`mlaserve token-map`: the N most frequent tokens of a corpus, for `--speculative-token-map`.

Encodes every file given (directories: every file under them whose name matches `--glob`) with the checkpoint's
tokenizer, counts each token id, and writes the `--size` most frequent ids (ties: the lower id first) as a 1-D int64
tensor in a `.pt` file, or a list in a `.json` file. The draft head then reads only those rows; the outputs do not
change, only how often a draft is accepted (a token outside the map is never drafted).

    mlaserve token-map --model-path mlaserve/demo --corpus /usr/lib/python3.11 --glob "*.py" --size 2048 --out map.pt
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from mlaserve.tokenizer import load_tokenizer
from mlaserve.tools.corpus import MAX_FILE_BYTES, read_source


def corpus_files(paths: Iterable[str | Path], glob: str = "*") -> Iterator[Path]:
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(f for f in p.rglob(glob) if f.is_file())
        elif p.is_file():
            yield p
        else:
            raise FileNotFoundError(f"--corpus {p}: no such file or directory")


def count_tokens(backend, texts: Iterable[str], vocab_size: int, batch: int = 256) -> np.ndarray:
    """How often each token id occurs in `texts` (int64 [vocab_size]); `backend` a `tokenizers.Tokenizer`."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    chunk: list[str] = []

    def flush() -> None:
        for enc in encode(chunk, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int64)
            counts[:] += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
        chunk.clear()

    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            flush()
    if chunk:
        flush()
    return counts


def top_ids(counts: np.ndarray, size: int) -> torch.Tensor:
    """The `size` most frequent ids, sorted by id (a stable sort on -count keeps the lower id of a tie)."""
    order = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(order)).to(torch.int64)


def write(ids: torch.Tensor, out: Path) -> None:
    if out.suffix == ".json":
        out.write_text(json.dumps(ids.tolist()))
    elif out.suffix == ".pt":
        torch.save(ids, out)
    else:
        raise ValueError(f"--out {out}: expected a .pt or .json file name")


def _texts(files: Iterable[Path]) -> Iterator[str]:
    """UTF-8 texts of `files` one at a time (unreadable and generated-table-sized files skipped, as the corpus does)."""
    for f in files:
        if f.stat().st_size <= MAX_FILE_BYTES and (text := read_source(f)):
            yield text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlaserve token-map", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True, help="checkpoint directory (its tokenizer.json and config.json)")
    ap.add_argument("--corpus", nargs="+", required=True, help="text files or directories to count")
    ap.add_argument("--glob", default="*", help="file names to read under a directory (default: all)")
    ap.add_argument("--size", type=int, default=32768, help="how many token ids to keep (default 32768)")
    ap.add_argument("--out", required=True, help="output file, .pt (a 1-D int64 tensor) or .json (a list)")
    args = ap.parse_args(argv)
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    if not 1 <= args.size <= vocab:
        ap.error(f"--size {args.size}: must be in 1 .. {vocab} (the checkpoint's vocab_size)")
    out = Path(args.out)
    if out.suffix not in (".pt", ".json"):
        ap.error(f"--out {out}: expected a .pt or .json file name")
    try:
        files = list(corpus_files(args.corpus, args.glob))
    except FileNotFoundError as e:
        ap.error(str(e))
    tok = load_tokenizer(args.model_path)
    counts = count_tokens(tok.backend, _texts(files), vocab)
    total = int(counts.sum())
    if total == 0:
        ap.error("the corpus has no tokens (no readable text files)")
    ids = top_ids(counts, args.size)
    write(ids, out)
    covered = int(counts[ids.numpy()].sum())
    print(f"wrote {out}: {len(ids)} of {vocab} token ids, covering {covered / total:.1%} of the {total} tokens "
          f"of {len(files)} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
