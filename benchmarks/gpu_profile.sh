set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MLASERVE_CACHE=/tmp/mlaserve-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
python3 benchmarks/profile_decode.py --bs 1 > $OUT/prof_v2l_bs1.txt 2>&1; head -50 $OUT/prof_v2l_bs1.txt
python3 benchmarks/profile_decode.py --bs 64 > $OUT/prof_v2l_bs64.txt 2>&1; head -3 $OUT/prof_v2l_bs64.txt
python3 benchmarks/profile_decode.py --bs 1 --model-config /tmp/v3_4l.json > $OUT/prof_v3_bs1.txt 2>&1; head -30 $OUT/prof_v3_bs1.txt
python3 benchmarks/profile_decode.py --bs 64 --model-config /tmp/v3_4l.json > $OUT/prof_v3_bs64.txt 2>&1; head -3 $OUT/prof_v3_bs64.txt
