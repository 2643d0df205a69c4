# Sourced by the GPU serving scripts: the carried wheels on PYTHONPATH, $OUT, and $M: a V2-Lite checkpoint directory
# (the full config, for --load-format dummy) with a trained test tokenizer.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
