"""Compare a retrained demo checkpoint with the shipped one: tokenizer/config identity, per-tensor weight drift.

Usage: python compare_ckpt.py NEW_DIR SHIPPED_DIR
"""
import hashlib
import sys
from pathlib import Path

from safetensors.torch import load_file


def load(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16]


new, old = Path(sys.argv[1]), Path(sys.argv[2])
for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
    a, b = new / name, old / name
    print(f"{name}: {'identical' if a.read_bytes() == b.read_bytes() else 'DIFFERENT'} ({sha(a)} vs {sha(b)})")
wa, wb = load(new), load(old)
print(f"tensors: {len(wa)} new, {len(wb)} shipped, same names: {set(wa) == set(wb)}")
rows = []
for k in sorted(set(wa) & set(wb)):
    x, y = wa[k].float(), wb[k].float()
    rel = ((x - y).norm() / y.norm().clamp_min(1e-12)).item()
    rows.append((rel, k, (x == y).all().item()))
rows.sort()
rels = [r[0] for r in rows]
print(f"bit-identical tensors: {sum(r[2] for r in rows)} of {len(rows)}")
print(f"relative L2 drift |new - shipped| / |shipped|: median {rels[len(rels) // 2]:.4f}, max {rels[-1]:.4f}")
for rel, k, _ in rows[:3] + rows[-5:]:
    print(f"  {rel:.4f}  {k}")
