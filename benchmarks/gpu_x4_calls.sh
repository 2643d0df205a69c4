#!/usr/bin/env bash
# The next device session's calls on nvidia-h200-x4 (four GPUs, 10 minutes a call), as planned in
# benchmarks/results/tp-h200x2.md ("Prepared for the next device session"): each call runs jobs side by side on
# their own GPUs through benchmarks/gpu_jobs.sh. Carry .whlx.
#   bash benchmarks/gpu_x4_calls.sh A    tune the FP8 GEMMs at tp 2's shapes (GPU 0); the padding-mask timing (GPU 1);
#                                        V2-Lite tp 1 vs tp 2 and V3 at tp 1 / 2 (GPUs 2-3)
#   bash benchmarks/gpu_x4_calls.sh B    issue 17: rows 10 11 3 / 12 13 6 at concurrency 768, offline table only
#   bash benchmarks/gpu_x4_calls.sh C    issue 17: rows 14 15 / 4 8 7 at 768
#   bash benchmarks/gpu_x4_calls.sh F    issue 17: rows 15 7 / 8 at 768 (what C left)
#   bash benchmarks/gpu_x4_calls.sh G    issue 17: row 7 at 768 (GPUs 0-1); the compile rows 0 2 1, single query then 16,
#                                        with their server logs (GPUs 2-3: the half-speed first level)
#   bash benchmarks/gpu_x4_calls.sh D    issue 18's script at tp 4 on all four GPUs: one-batch (graphs, compile, EAGLE)
#   bash benchmarks/gpu_x4_calls.sh E    the same, serving: tp 4 and dp 4 + ep 4 at 16 / 256 / 768
# Planned after the seventh session (its calls: G, A, D, E):
#   bash benchmarks/gpu_x4_calls.sh H    the compile rows 0 and 1 against rows 5 and 9 at single query and 16 after
#                                        the recompile-limit fix, logs kept (GPUs 0-1); tune the tp 4 tables: fused
#                                        MoE E=256,N=512 (GPU 2), the four FP8 GEMM shapes (GPU 3)
#   bash benchmarks/gpu_x4_calls.sh I    tp 4, 24 layers, with H's tables: one-batch (whole output, stacks each 60 s),
#                                        then one bs-1 profile
#   bash benchmarks/gpu_x4_calls.sh J    V3 20 layers at tp 2 with the tp 2 GEMM tables, whole log (GPUs 0-1); the
#                                        tp 2 prefill profile of V2-Lite, 1 x 256 (GPUs 2-3)
# Planned in the fourteenth session (two x2 calls and the one-GPU prefetch A/B in two x4 calls):
#   bash benchmarks/gpu_x4_calls.sh K    gpu_x2_calls.sh V (GPUs 0-1) beside gpu_x2_calls.sh W (GPUs 2-3)
#   bash benchmarks/gpu_x4_calls.sh L    gpu_merge_moe.sh prefetch (GPU 0; ran at 6a0ca60, the part went with the
#                                        prefetch); the piecewise-compile-spec combination row (GPU 1); torch.compile
#                                        without graphs at tp 2 ep 2 / dp 2 / spec (GPUs 2-3)
# After calls A and H, commit the tables from their tune jobs' tgz (configs/) before the later calls use them.
set -uo pipefail
ABL="CONCURRENCY=768 TABLES=offline LIMIT=540 bash benchmarks/gpu_ablation_2gpu.sh"
case "${1:-}" in
  A) bash benchmarks/gpu_jobs.sh 560 "0|TABLES_INTO_TREE=0 bash benchmarks/gpu_tune.sh gemm-tp2" \
       "1|bash benchmarks/gpu_pad_mask.sh" "2,3|bash benchmarks/gpu_tp.sh one-batch v3" ;;
  K) bash benchmarks/gpu_jobs.sh 570 "0,1|bash benchmarks/gpu_x2_calls.sh V" \
       "2,3|SKIP_COMPILE=1 T1=200 T3=180 T5=180 bash benchmarks/gpu_x2_calls.sh W" ;;
  L) bash benchmarks/gpu_jobs.sh 570 "0|bash benchmarks/gpu_merge_moe.sh prefetch" \
       "1|source benchmarks/gpu_v2l_env.sh; timeout 560 python3 -m pytest -v -p no:cacheprovider tests/test_combinations.py -k 'gpu_graphs_and_compile and piecewise-compile-spec' > \$OUT/tests_combo_pcs.txt 2>&1; tail -5 \$OUT/tests_combo_pcs.txt" \
       "2,3|source benchmarks/gpu_v2l_env.sh; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; timeout 560 python3 -m pytest -q -p no:cacheprovider -rfE -k nographs tests/test_combinations.py > \$OUT/tests_nographs.txt 2>&1; tail -8 \$OUT/tests_nographs.txt" ;;
  B) bash benchmarks/gpu_jobs.sh 560 "0,1|ROWS='10 11 3' $ABL" "2,3|ROWS='12 13 6' $ABL" ;;
  C) bash benchmarks/gpu_jobs.sh 560 "0,1|ROWS='14 15' $ABL" "2,3|ROWS='4 8 7' $ABL" ;;
  F) A="CONCURRENCY=768 TABLES=offline LIMIT=470 bash benchmarks/gpu_ablation_2gpu.sh"
     bash benchmarks/gpu_jobs.sh 490 "0,1|ROWS='15 7' $A" "2,3|ROWS='8' $A" ;;
  G) bash benchmarks/gpu_jobs.sh 560 "0,1|ROWS='7' $ABL" \
       "2,3|ROWS='0 2 1' CONCURRENCY=16 KEEP_LOGS=1 LIMIT=540 bash benchmarks/gpu_ablation_2gpu.sh" ;;
  D) bash benchmarks/gpu_jobs.sh 560 "0,1,2,3|GPUS=4 V3_LAYERS=24 LIMIT=180 bash benchmarks/gpu_v3_scale.sh one-batch" ;;
  E) bash benchmarks/gpu_jobs.sh 560 "0,1,2,3|GPUS=4 V3_LAYERS=24 CONCURRENCY='16 256 768' \
       bash benchmarks/gpu_v3_scale.sh serve tp dp-ep" ;;
  H) bash benchmarks/gpu_jobs.sh 560 "0,1|ROWS='0 5 1 9' CONCURRENCY=16 KEEP_LOGS=1 LIMIT=540 bash benchmarks/gpu_ablation_2gpu.sh" \
       "2|TABLES_INTO_TREE=0 bash benchmarks/gpu_tune.sh moe-tp4" "3|TABLES_INTO_TREE=0 bash benchmarks/gpu_tune.sh gemm-tp4" ;;
  I) P="python3 benchmarks/v3_config.py --layers 24 --out /tmp/v3_24.json && PYTHONPATH=\$PWD:/tmp/site timeout 150 \
       python3 -m mlaserve.cli bench \
       one-batch --load-format dummy --model-config /tmp/v3_24.json --batch-size 1 --output-len 8 --tp-size 4 --profile \
       --profile-dir \$OUT/prof > \$OUT/profile.log 2>&1"
     bash benchmarks/gpu_jobs.sh 560 "0,1,2,3|GPUS=4 V3_LAYERS=24 LIMIT=200 RUNS_ONLY=plain bash benchmarks/gpu_v3_scale.sh one-batch; $P" ;;
  J) bash benchmarks/gpu_jobs.sh 560 "0,1|V3_LAYERS=20 bash benchmarks/gpu_tp.sh v3" \
       "2,3|PYTHONPATH=\$PWD:/tmp/site timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy \
       --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 --input-len 256 --output-len 4 \
       --tp-size 2 --profile --profile-dir \$OUT/prof > \$OUT/tp2_prefill_profile.log 2>&1" ;;
  *) echo "usage: $0 A|B|C|F|G|D|E|H|I|J|K|L"; exit 2 ;;
esac
