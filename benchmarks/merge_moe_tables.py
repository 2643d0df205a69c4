"""Merge freshly tuned fused-MoE tables into the shipped ones: `python3 benchmarks/merge_moe_tables.py NEW_DIR OUT_DIR`.

For each table in NEW_DIR, the token counts it holds replace those of the table of the same name in
mlaserve/kernels/configs (kept otherwise); the merged table goes to OUT_DIR and into the tree. A tuning run over a few
token counts (`--batch-sizes 1 2 4 8 16`) thus updates those rows only."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mlaserve.kernels.fused_moe import CONFIG_DIR


def main(new_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(new_dir.glob("*.json")):
        shipped = CONFIG_DIR / path.name
        table = json.loads(shipped.read_text()) if shipped.is_file() else {}
        new = json.loads(path.read_text())
        for m, cfg in new.items():
            print(f"{path.name} T={m}: {table.get(m)} -> {cfg}")
        table.update(new)
        text = json.dumps(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), indent=2) + "\n"
        (out_dir / path.name).write_text(text)
        shipped.write_text(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
