"""`bench one-batch` with the shared-in-router tile overridden (one process per variant: the graphs are captured
with it): --rows-values sets moe_topk.SHARED_ROWS_VALUES (weights one shared program holds), --warps
SHARED_NUM_WARPS; the remaining arguments go to `mlaserve bench one-batch`."""
import argparse
import sys

import mlaserve.kernels.moe_topk as mt
from mlaserve.cli import main

ap = argparse.ArgumentParser()
ap.add_argument("--rows-values", type=int, default=mt.SHARED_ROWS_VALUES)
ap.add_argument("--warps", type=int, default=mt.SHARED_NUM_WARPS)
a, rest = ap.parse_known_args()
mt.SHARED_ROWS_VALUES, mt.SHARED_NUM_WARPS = a.rows_values, a.warps
print(f"shared programs: {a.rows_values} values, {a.warps} warps")
sys.exit(main(["bench", "one-batch", *rest]))
