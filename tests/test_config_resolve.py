"""resolve_config: every automatic choice made, every flag acting or rejected in one line naming it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import mlaserve
from mlaserve.config import ConfigError, ModelConfig, ServerConfig
from mlaserve.config_resolve import (CPU_DEFAULT_TOKENS, DeviceInfo, default_batch_sizes, probe_device,
                                     require_resolved, resolve_config, resolved_args)

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"
V2_LITE = ModelConfig.from_dict(json.loads((CONFIGS / "deepseek-v2-lite.json").read_text()))
V3_FP8 = ModelConfig.from_dict(json.loads((CONFIGS / "deepseek-v3.json").read_text()))
ALL_MOE = ModelConfig.from_dict(json.loads((CONFIGS / "deepseek-v2-lite.json").read_text()) | {"first_k_dense_replace": 0})
CPU = DeviceInfo("cpu", triton=False)
CPU_INTERPRETED = DeviceInfo("cpu", triton=True)
H100 = DeviceInfo("cuda", 0, "NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0), triton=True)
A100 = DeviceInfo("cuda", 0, "NVIDIA A100-SXM4-80GB", 80 * 2**30, (8, 0), triton=True)
GPU_UNPROBED = DeviceInfo("cuda", 0, triton=True)          # the main process's view: no properties read


def resolve(device: DeviceInfo = CPU, model: ModelConfig = V2_LITE, **flags) -> ServerConfig:
    return resolve_config(ServerConfig.from_flat(**flags), model, device)


def test_cpu_defaults_resolve_to_values():
    r = resolve(CPU)
    require_resolved(r)
    args = resolved_args(r)
    assert "auto" not in args.values()
    assert (r.load.device, r.load.dtype, r.load.attention_backend, r.cache.kv_cache_dtype) == \
        ("cpu", "float32", "torch", "float32")
    assert r.load.context_length == V2_LITE.max_position_embeddings and r.load.load_format == "safetensors"
    assert (r.cache.max_total_tokens, r.cache.mem_fraction_static) == (CPU_DEFAULT_TOKENS, None)
    assert r.sched.max_running_requests == 64
    assert (r.sched.disable_cuda_graph, r.sched.cuda_graph_bs, r.sched.cuda_graph_max_bs) == (True, [], 0)
    assert (r.sched.enable_torch_compile, r.sched.torch_compile_max_bs) == (False, 0)


def test_gpu_defaults_resolve_to_values():
    r = resolve(H100)
    require_resolved(r)
    assert (r.load.device, r.load.dtype, r.load.attention_backend, r.cache.kv_cache_dtype) == \
        ("cuda:0", "bfloat16", "triton", "bfloat16")
    assert (r.cache.mem_fraction_static, r.cache.max_total_tokens) == (0.85, None)   # sized from memory at start
    assert r.sched.max_running_requests == 256 and not r.sched.disable_cuda_graph
    assert r.sched.cuda_graph_max_bs == 160 and r.sched.cuda_graph_bs == default_batch_sizes(160)
    assert r.sched.cuda_graph_bs[:5] == [1, 2, 4, 8, 16] and r.sched.cuda_graph_bs[-1] == 160
    assert resolve(DeviceInfo("cuda", 0, "V100", 2**34, (7, 0), True)).load.dtype == "float16"   # no bf16


def test_graph_and_compile_sizes_follow_the_running_limit():
    r = resolve(H100, max_running_requests=12, enable_torch_compile=True)
    assert r.sched.cuda_graph_max_bs == 12 and r.sched.cuda_graph_bs == [1, 2, 4, 8, 12]
    assert r.sched.torch_compile_max_bs == 12
    r = resolve(H100, cuda_graph_bs=[4, 1, 64], enable_torch_compile=True)
    assert (r.sched.cuda_graph_bs, r.sched.cuda_graph_max_bs, r.sched.torch_compile_max_bs) == ([1, 4, 64], 64, 32)


def test_torch_compile_without_graphs_resolves_to_eager_compiled_sizes():
    """--disable-cuda-graph --enable-torch-compile (the seeds' ablation row): no graphs, decode batches up to the
    compile size run compiled and eagerly; resolving again keeps it."""
    r = resolve(H100, disable_cuda_graph=True, enable_torch_compile=True)
    assert r.sched.disable_cuda_graph and r.sched.cuda_graph_bs == [] and r.sched.cuda_graph_max_bs == 0
    assert r.sched.torch_compile_max_bs == 32
    r = resolve(H100, disable_cuda_graph=True, enable_torch_compile=True, torch_compile_max_bs=4,
                max_running_requests=8)
    assert r.sched.torch_compile_max_bs == 4 and r == resolve_config(r, V2_LITE, H100)      # idempotent
    assert resolve(H100, disable_cuda_graph=True, enable_torch_compile=True,
                   max_running_requests=12).sched.torch_compile_max_bs == 12


@pytest.mark.parametrize("why,flags", [
    ("torch kernels", dict(attention_backend="torch")),
    ("non-absorbed decode", dict(disable_mla=True)),
    ("asked", dict(disable_cuda_graph=True)),
])
def test_cuda_graphs_resolve_off_on_the_gpu(why, flags):
    r = resolve(H100, **flags)
    assert r.sched.disable_cuda_graph and r.sched.cuda_graph_bs == [] and r.sched.cuda_graph_max_bs == 0, why


@pytest.mark.parametrize("device,flags", [
    (CPU, {}), (H100, {}), (H100, dict(kv_cache_dtype="fp8_e4m3", cuda_graph_bs=[1, 8])),
    (CPU, dict(kv_cache_dtype="bf16", max_total_tokens=100)), (H100, dict(attention_backend="torch")),
    (H100, dict(enable_torch_compile=True, torch_compile_max_bs=8)),
])
def test_resolving_twice_changes_nothing(device, flags):
    once = resolve(device, **flags)
    assert resolve_config(once, V2_LITE, device) == once


def test_kv_cache_dtype_choices():
    assert resolve(H100, kv_cache_dtype="fp8_e5m2").cache.kv_cache_dtype == "fp8_e5m2"
    assert resolve(H100, kv_cache_dtype="bf16").cache.kv_cache_dtype == "bfloat16"
    assert resolve(A100, kv_cache_dtype="fp8_e5m2").cache.kv_cache_dtype == "fp8_e5m2"      # e5m2 works on sm80
    assert resolve(CPU, kv_cache_dtype="fp8_e4m3").cache.kv_cache_dtype == "fp8_e4m3"       # the torch reference
    assert resolve(CPU, kv_cache_dtype="bf16").cache.kv_cache_dtype == "bfloat16"           # torch: any dtype


def test_fp8_checkpoint_runs_dequantised_or_on_new_gpus():
    assert resolve(H100, V3_FP8).load.attention_backend == "triton"
    assert resolve(A100, V3_FP8, dequant_fp8=True).load.dequant_fp8
    assert resolve(GPU_UNPROBED, V3_FP8).load.device == "cuda:0"       # unknown capability: left to the scheduler


@pytest.mark.parametrize("device,model,flags,words", [
    (CPU, V2_LITE, dict(tp_size=3), "--tp-size 3: model.layers.0.self_attn.q_proj.weight has 16 heads"),
    (H100, V3_FP8, dict(tp_size=32), "--tp-size 32: model.layers.0.mlp.down_proj.weight has 18432 columns"),
    (CPU, V2_LITE, dict(tp_size=4, nnodes=3), "--tp-size 4 --nnodes 3"),
    (CPU, V2_LITE, dict(tp_size=2, nnodes=2), "--nnodes 2: give --dist-init-addr"),
    (CPU, V2_LITE, dict(node_rank=1), "--node-rank 1"),
    (CPU, V2_LITE, dict(dist_init_addr="nohost"), "--dist-init-addr nohost"),
    (CPU, V2_LITE, dict(dist_timeout=0.0), "--dist-timeout 0.0"),
    (CPU, V2_LITE, dict(base_gpu_id=1), "--base-gpu-id 1"),
    (H100, V2_LITE, dict(dp_size=4), "--dp-size 4"),
    (H100, V2_LITE, dict(enable_dp_attention=True), "--enable-dp-attention with --dp-size 1"),
    (H100, V2_LITE, dict(tp_size=4, dp_size=3, enable_dp_attention=True), "--tp-size 4 --dp-size 3"),
    (H100, V2_LITE, dict(tp_size=64, dp_size=2, enable_dp_attention=True),
     "--tp-size 64 --dp-size 2: model.layers.0.self_attn.q_proj.weight has 16 heads"),
    (CPU, V2_LITE, dict(tp_size=4, dp_size=2, enable_dp_attention=True, nnodes=2, dist_init_addr="h:65534"),
     "--dist-init-addr h:65534: DP attention over several nodes takes the 3 ports after it"),
    (CPU, V2_LITE, dict(load_balance_method="round_robin"), "--load-balance-method round_robin"),
    (CPU, V2_LITE, dict(tp_size=2, moe_dense_tp_size=2), "--moe-dense-tp-size 2: only 1"),
    (CPU, V2_LITE, dict(tp_size=2, dp_size=2, enable_dp_attention=True, moe_dispatch="all_to_all"),
     "--moe-dispatch all_to_all: needs expert parallelism"),
    (CPU, V2_LITE, dict(tp_size=2, ep_size=2, moe_dispatch="all_to_all"),
     "--moe-dispatch all_to_all: acts only with --enable-dp-attention"),
    (CPU, V2_LITE, dict(moe_dispatch="deepep"), "--moe-dispatch deepep: choose one of gather, all_to_all"),
    (CPU, ALL_MOE, dict(tp_size=2, moe_dense_tp_size=1), "--moe-dense-tp-size 1: this model has no dense MLP"),
    (H100, V3_FP8, dict(tp_size=32, moe_dense_tp_size=1),
     "--tp-size 32: model.layers.3.mlp.experts.0.down_proj.weight has 2048 columns"),
    (CPU, V2_LITE, dict(tp_size=2, enable_dp_lm_head=True), "--enable-dp-lm-head: acts only with --enable-dp-attention"),
    (CPU, V2_LITE, dict(load_balance_method="random"), "--load-balance-method random: choose one of"),
    (H100, V3_FP8, dict(tp_size=2, dp_size=2, enable_dp_attention=True, cuda_graph_max_bs=8,
                        disable_cuda_graph=True), "--cuda-graph-max-bs: these act on CUDA graphs, which are off "
                                              "with --disable-cuda-graph"),
    (H100, V2_LITE, dict(tp_size=0), "--tp-size 0"),
    (CPU, V2_LITE, dict(enable_torch_compile=True), "--enable-torch-compile"),
    (CPU, V2_LITE, dict(cuda_graph_bs=[1, 2]), "--cuda-graph-bs"),
    (CPU, V2_LITE, dict(cuda_graph_max_bs=8), "--cuda-graph-max-bs"),
    (H100, V2_LITE, dict(attention_backend="torch", enable_torch_compile=True), "--attention-backend torch"),
    (H100, V2_LITE, dict(disable_mla=True, cuda_graph_max_bs=8), "--disable-mla"),
    (H100, V2_LITE, dict(disable_cuda_graph=True, attention_backend="torch", enable_torch_compile=True),
     "--enable-torch-compile: torch.compile acts on the CUDA decode path (with or without graphs), which "
     "--attention-backend torch rules out"),
    (H100, V2_LITE, dict(disable_cuda_graph=True, torch_compile_max_bs=8), "--torch-compile-max-bs: acts only"),
    (H100, V2_LITE, dict(torch_compile_max_bs=8), "--torch-compile-max-bs"),
    (H100, V2_LITE, dict(cuda_graph_bs=[1, 8], cuda_graph_max_bs=16), "--cuda-graph-max-bs 16"),
    (H100, V2_LITE, dict(cuda_graph_bs=[0, 8]), "--cuda-graph-bs 0 8"),
    (CPU, V2_LITE, dict(mem_fraction_static=0.5), "--mem-fraction-static"),
    (H100, V2_LITE, dict(mem_fraction_static=1.5), "--mem-fraction-static 1.5"),
    (CPU, V2_LITE, dict(max_total_tokens=0), "--max-total-tokens 0"),
    (CPU, V2_LITE, dict(context_length=10**7), "--context-length 10000000"),
    (CPU, V2_LITE, dict(dequant_fp8=True), "--dequant-fp8"),
    (CPU, V2_LITE, dict(attention_backend="triton"), "--attention-backend triton"),
    (H100, V2_LITE, dict(dtype="float32", kv_cache_dtype="bf16"), "--kv-cache-dtype bfloat16 with --dtype float32"),
    (A100, V2_LITE, dict(kv_cache_dtype="fp8_e4m3"), "--kv-cache-dtype fp8_e4m3"),
    (A100, V3_FP8, {}, "--dequant-fp8"),
    (CPU, V2_LITE, dict(dtype="float64"), "--dtype float64"),
    (CPU, V2_LITE, dict(attention_backend="flashinfer"), "--attention-backend flashinfer"),
    (CPU, V2_LITE, dict(tool_call_parser="qwen"), "--tool-call-parser qwen"),
    (CPU, V2_LITE, dict(chunked_prefill_size=0), "--chunked-prefill-size 0"),
    (CPU, V2_LITE, dict(max_running_requests=0), "--max-running-requests 0"),
    (CPU, V2_LITE, dict(min_new_token_ratio=0.9), "--min-new-token-ratio 0.9"),
    (CPU, V2_LITE, dict(watchdog_timeout=0.0), "--watchdog-timeout"),
    (CPU, V2_LITE, dict(schedule_policy="lpm", disable_radix_cache=True),
     "--schedule-policy lpm with --disable-radix-cache"),
])
def test_unsupported_combinations_fail_in_one_line_naming_the_flags(device, model, flags, words):
    with pytest.raises(ConfigError) as e:
        resolve(device, model, **flags)
    msg = str(e.value)
    assert words in msg and "\n" not in msg, msg


def test_tensor_parallel_configs_resolve():
    r = resolve(CPU, V2_LITE, tp_size=2)
    assert (r.parallel.tp_size, r.parallel.dist_timeout) == (2, 600.0)
    assert resolve(H100, V3_FP8, tp_size=8).parallel.tp_size == 8           # DeepSeek-V3 FP8 on one 8-GPU node
    assert resolve(H100, V3_FP8, tp_size=16, nnodes=2, dist_init_addr="10.0.0.1:5000").parallel.nnodes == 2
    assert resolve(CPU, V2_LITE, tp_size=2) == resolve_config(r, V2_LITE, CPU)  # idempotent


def test_dp_attention_configs_resolve():
    r = resolve(CPU, V2_LITE, tp_size=2, dp_size=2, enable_dp_attention=True)
    assert (r.parallel.dp_size, r.parallel.load_balance_method) == (2, "shortest_queue")
    assert r == resolve_config(r, V2_LITE, CPU)                                # idempotent
    # SGLang's 8-GPU recipe (--tp 8 --dp 8) and 2 groups of 8 (attention over 8 ranks, the MoE over 16)
    r = resolve(H100, V3_FP8, tp_size=8, dp_size=8, enable_dp_attention=True, load_balance_method="round_robin")
    assert r.parallel.load_balance_method == "round_robin"
    assert not r.sched.disable_cuda_graph and r.sched.cuda_graph_bs          # keyed by the groups' agreed size
    assert r == resolve_config(r, V3_FP8, H100)
    r = resolve(H100, V3_FP8, tp_size=8, dp_size=8, enable_dp_attention=True, speculative_algorithm="EAGLE",
                enable_torch_compile=True)                                    # draft + verify graphs too
    assert not r.sched.disable_cuda_graph and r.sched.torch_compile_max_bs > 0
    assert resolve(H100, V3_FP8, tp_size=16, dp_size=2, enable_dp_attention=True).parallel.dp_size == 2
    # two nodes of 8 GPUs, 16 groups (SGLang's --tp 16 --dp 16 --enable-dp-attention --nnodes 2)
    r = resolve(H100, V3_FP8, tp_size=16, dp_size=16, enable_dp_attention=True, nnodes=2, node_rank=1,
                dist_init_addr="10.0.0.1:5000")
    assert (r.parallel.nnodes, r.parallel.dp_size) == (2, 16)
    # SGLang's DP-attention flags for the dense layers and lm_head
    r = resolve(H100, V3_FP8, tp_size=16, dp_size=2, enable_dp_attention=True, moe_dense_tp_size=1,
                enable_dp_lm_head=True)
    assert (r.parallel.moe_dense_tp_size, r.parallel.enable_dp_lm_head) == (1, True)
    r = resolve(H100, V3_FP8, tp_size=8, dp_size=8, enable_dp_attention=True, ep_size=8, moe_dispatch="all_to_all")
    assert r.parallel.moe_dispatch == "all_to_all" and not r.sched.disable_cuda_graph   # graphs keep the gather


def test_triton_on_the_cpu_needs_the_interpreter():
    r = resolve(CPU_INTERPRETED, attention_backend="triton")
    assert r.load.attention_backend == "triton" and r.sched.disable_cuda_graph


def test_unresolved_config_is_refused():
    with pytest.raises(ValueError, match="device, dtype"):
        require_resolved(ServerConfig())


def test_probe_device_names():
    cpu = probe_device("cpu")
    assert cpu.type == "cpu" and cpu.torch_name == "cpu"
    for bad in ("tpu", "cuda:x"):
        with pytest.raises(ConfigError, match=f"--device {bad}"):
            probe_device(bad)
    if not torch.cuda.is_available():
        assert probe_device("auto").type == "cpu"
        with pytest.raises(ConfigError, match="no CUDA device"):
            probe_device("cuda")


def test_speculative_decoding_resolves_sglang_defaults():
    r = resolve(H100, V3_FP8, speculative_algorithm="NEXTN")
    s = r.sched
    assert (s.speculative_algorithm, s.speculative_num_steps, s.speculative_eagle_topk,
            s.speculative_num_draft_tokens) == ("EAGLE", 3, 1, 4)
    assert not s.disable_overlap_schedule and not s.disable_cuda_graph  # overlap stays on; graphs: draft + verify
    assert resolve_config(r, V3_FP8, H100) == r
    r = resolve(CPU, V3_FP8, speculative_algorithm="EAGLE", speculative_num_steps=1)
    assert (r.sched.speculative_num_steps, r.sched.speculative_num_draft_tokens) == (1, 2)


@pytest.mark.parametrize("model,flags,words", [
    (V2_LITE, dict(speculative_algorithm="EAGLE"), "no MTP (NextN) layer"),
    (V3_FP8, dict(speculative_num_steps=2), "--speculative-num-steps: act only with --speculative-algorithm"),
    (V3_FP8, dict(speculative_algorithm="EAGLE", speculative_eagle_topk=2, speculative_num_draft_tokens=12),
     "--speculative-num-draft-tokens 12: with --speculative-eagle-topk 2 and --speculative-num-steps 3 it must be "
     "in [2, 11]"),
    (V3_FP8, dict(speculative_algorithm="EAGLE", speculative_eagle_topk=8, speculative_num_steps=3,
                  speculative_num_draft_tokens=80), "must be in [2, 64]"),
    (V3_FP8, dict(speculative_algorithm="EAGLE", speculative_eagle_topk=0), "must be >= 1"),
    (V3_FP8, dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_num_draft_tokens=8),
     "must be 4"),
    (V3_FP8, dict(speculative_algorithm="EAGLE", speculative_num_steps=0), "must be >= 1"),
    (V3_FP8, dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/elsewhere"),
     "--speculative-draft-model-path /elsewhere: no such directory"),
])
def test_speculative_flags_fail_in_one_line(model, flags, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        resolve(CPU, model, **flags)
    assert "\n" not in str(e.value)


def draft_dir(root: Path, name: str, config: dict | str | None) -> str:
    path = root / name
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def test_speculative_draft_model_path_resolves(tmp_path):
    """A NextN export or a full checkpoint with an MTP layer drafts for a target with or without one of its own."""
    v3 = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    nextn = draft_dir(tmp_path, "nextn", v3 | {"num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"],
                                               "num_nextn_predict_layers": 1})
    full = draft_dir(tmp_path, "full", v3)
    for model in (V3_FP8, V3_FP8.with_(num_nextn_predict_layers=0)):
        for path in (nextn, full):
            r = resolve(CPU, model, speculative_algorithm="EAGLE", speculative_draft_model_path=path)
            assert r.sched.speculative_draft_model_path == path and resolve_config(r, model, CPU) == r
    r = resolve(CPU, V3_FP8, model_path=full, speculative_algorithm="EAGLE", speculative_draft_model_path=full + "/")
    assert r.sched.speculative_algorithm == "EAGLE"           # the target's own directory: its MTP layer drafts


def test_speculative_draft_model_path_fails_in_one_line(tmp_path):
    v3 = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    v2_lite = json.loads((CONFIGS / "deepseek-v2-lite.json").read_text())
    nextn = v3 | {"num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"]}
    (tmp_path / "file").write_text("")
    cases = [(str(tmp_path / "none"), "no such directory"), (str(tmp_path / "file"), "no such directory"),
             (draft_dir(tmp_path, "empty", None), "no config.json in the directory"),
             (draft_dir(tmp_path, "garbled", "{not json"), "config.json is not valid JSON"),
             (draft_dir(tmp_path, "v2-lite", v2_lite),
              "this checkpoint has no MTP (NextN) layer to draft with (num_nextn_predict_layers is 0 in its "
              "config.json and its architectures are not DeepseekV3ForCausalLMNextN)"),
             (draft_dir(tmp_path, "wide", nextn | {"hidden_size": 4096}),
              "hidden_size is 4096 in its config.json and 7168 in the target's"),
             (draft_dir(tmp_path, "experts", nextn | {"n_routed_experts": 128}),
              "n_routed_experts is 128 in its config.json and 256 in the target's"),
             (draft_dir(tmp_path, "softmax", nextn | {"topk_method": "greedy", "scoring_func": "softmax"}),
              "topk_method is 'greedy' in its config.json and 'noaux_tc' in the target's"),
             (draft_dir(tmp_path, "bf16", {k: v for k, v in nextn.items() if k != "quantization_config"}),
              "quantization_config is none in its config.json and fp8 e4m3 blocks [128, 128] in the target's"),
             (draft_dir(tmp_path, "deeper", v3 | {"num_hidden_layers": 62}),
              "num_hidden_layers is 62 in its config.json and 61 in the target's"),
             (draft_dir(tmp_path, "no-key", {k: v for k, v in nextn.items() if k != "kv_lora_rank"}),
              "config.json has no key 'kv_lora_rank'")]
    for path, words in cases:
        with pytest.raises(ConfigError, match=re.escape(f"--speculative-draft-model-path {path}: {words}")) as e:
            resolve(CPU, V3_FP8, speculative_algorithm="EAGLE", speculative_draft_model_path=path)
        assert "\n" not in str(e.value)


def test_mixed_chunk_resolves_with_every_layout_and_the_overlap_scheduler():
    for flags in ({}, dict(tp_size=8, dp_size=2, enable_dp_attention=True, ep_size=8), dict(tp_size=2)):
        r = resolve(H100, V3_FP8, enable_mixed_chunk=True, chunked_prefill_size=512, **flags)
        assert r.sched.enable_mixed_chunk and not r.sched.disable_overlap_schedule


def test_tree_drafts_resolve():
    r = resolve(CPU, V3_FP8, speculative_algorithm="EAGLE", speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    s = r.sched
    assert (s.speculative_num_steps, s.speculative_eagle_topk, s.speculative_num_draft_tokens) == (3, 4, 8)
    assert resolve_config(r, V3_FP8, CPU) == r
    r = resolve(H100, V3_FP8, speculative_algorithm="EAGLE", speculative_eagle_topk=2)     # default N: steps + 1
    assert (r.sched.speculative_eagle_topk, r.sched.speculative_num_draft_tokens) == (2, 4)
    assert not r.sched.disable_cuda_graph                 # the tree's draft + verify are captured too
    r = resolve(CPU, V3_FP8, tp_size=8, dp_size=2, enable_dp_attention=True, speculative_algorithm="EAGLE",
                speculative_eagle_topk=2)
    assert r.sched.speculative_eagle_topk == 2 and r.parallel.enable_dp_attention


def test_speculative_decoding_with_dp_attention_resolves():
    r = resolve(CPU, V3_FP8, tp_size=8, dp_size=2, enable_dp_attention=True, speculative_algorithm="EAGLE")
    assert r.sched.speculative_algorithm == "EAGLE" and r.parallel.enable_dp_attention


def test_speculative_decoding_with_torch_compile_resolves():
    r = resolve(H100, V3_FP8, speculative_algorithm="EAGLE", enable_torch_compile=True)
    assert r.sched.enable_torch_compile and r.sched.torch_compile_max_bs == 32 and r.sched.cuda_graph_max_bs == 160


def test_speculative_token_map_resolves_and_fails_in_one_line(tmp_path):
    path = tmp_path / "map.pt"
    path.write_bytes(b"")
    r = resolve(CPU, V3_FP8, speculative_algorithm="EAGLE", speculative_token_map=str(path))
    assert r.sched.speculative_token_map == str(path)
    for flags, words in [(dict(speculative_token_map=str(path)),
                          "--speculative-token-map: act only with --speculative-algorithm EAGLE"),
                         (dict(speculative_algorithm="EAGLE", speculative_token_map=str(tmp_path / "none.pt")),
                          "none.pt: no such file"),
                         (dict(speculative_algorithm="EAGLE", speculative_token_map=str(tmp_path)),
                          "no such file")]:
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            resolve(CPU, V3_FP8, **flags)
        assert "\n" not in str(e.value)
    txt = tmp_path / "map.txt"
    txt.write_text("1 2 3")
    with pytest.raises(ConfigError, match=re.escape("expected a .pt or .json file of token ids")):
        resolve(CPU, V3_FP8, speculative_algorithm="EAGLE", speculative_token_map=str(txt))


def test_piecewise_cuda_graphs_resolve():
    assert resolve(H100).sched.piecewise_cuda_graph_max_tokens == 0                        # off unless asked
    r = resolve(H100, V3_FP8, enable_piecewise_cuda_graph=True, tp_size=8, ep_size=8, enable_mixed_chunk=True,
                enable_torch_compile=True)
    assert r.sched.piecewise_cuda_graph_max_tokens == 4096 and r == resolve_config(r, V3_FP8, H100)
    r = resolve(H100, V3_FP8, enable_piecewise_cuda_graph=True, speculative_algorithm="EAGLE",
                piecewise_cuda_graph_max_tokens=1000)
    assert r.sched.piecewise_cuda_graph_max_tokens == 1000 and r == resolve_config(r, V3_FP8, H100)
    # with DP attention the ranks agree each step on the pieces' size (tests/distributed/test_dp_attention.py)
    for extra in (dict(enable_mixed_chunk=True), dict(speculative_algorithm="EAGLE", ep_size=2)):
        r = resolve(H100, V3_FP8, enable_piecewise_cuda_graph=True, tp_size=2, dp_size=2, enable_dp_attention=True,
                    **extra)
        assert r.sched.piecewise_cuda_graph_max_tokens == 4096 and r.parallel.enable_dp_attention
        assert r == resolve_config(r, V3_FP8, H100)


@pytest.mark.parametrize("device,flags,words", [
    (CPU, dict(enable_piecewise_cuda_graph=True), "--enable-piecewise-cuda-graph: these act on CUDA graphs, which "
     "are off with --device cpu"),
    (H100, dict(enable_piecewise_cuda_graph=True, disable_cuda_graph=True), "off with --disable-cuda-graph"),
    (H100, dict(piecewise_cuda_graph_max_tokens=512), "--piecewise-cuda-graph-max-tokens: acts only with "
     "--enable-piecewise-cuda-graph"),
    (H100, dict(enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=0), "must be >= 1"),
])
def test_piecewise_flags_fail_in_one_line(device, flags, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        resolve(device, V3_FP8, **flags)
    assert "\n" not in str(e.value)


def _parse(argv: list[str]) -> ServerConfig:
    import argparse

    from mlaserve.config import add_config_args, config_from_args
    parser = argparse.ArgumentParser(prog="mlaserve serve")
    add_config_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_sglang_flag_names_mean_the_same_here():
    """The seeds' launch lines: `--model`, `--tp`, `--dp`, `--ep`, the long `--*-parallel-size` forms, the older
    `--max-torch-compile-bs` and `--random-seed` set the same fields as our names; `--enable-ep-moe` is SGLang 0.4's
    expert parallelism over every rank."""
    c = _parse(["--model", "/m", "--tp", "8", "--dp", "8", "--enable-dp-attention", "--ep", "8",
                "--enable-torch-compile", "--max-torch-compile-bs", "4", "--random-seed", "7"])
    assert (c.load.model_path, c.parallel.tp_size, c.parallel.dp_size, c.parallel.ep_size) == ("/m", 8, 8, 8)
    assert (c.sched.torch_compile_max_bs, c.load.seed) == (4, 7)
    c = _parse(["--tensor-parallel-size", "4", "--data-parallel-size", "2", "--expert-parallel-size", "2"])
    assert (c.parallel.tp_size, c.parallel.dp_size, c.parallel.ep_size) == (4, 2, 2)
    assert _parse(["--tp-size", "2"]) == _parse(["--tp", "2"])
    assert ServerConfig.from_flat(random_seed=5).load.seed == 5               # SGLang's Engine keyword
    assert resolve(H100, V3_FP8, tp_size=8, enable_ep_moe=True).parallel.ep_size == 8
    assert resolve(H100, V3_FP8, tp_size=8, ep_size=8, enable_ep_moe=True).parallel.ep_size == 8
    with pytest.raises(ConfigError, match="^--enable-ep-moe --ep-size 2: --enable-ep-moe means --ep-size 8"):
        resolve(H100, V3_FP8, tp_size=8, ep_size=2, enable_ep_moe=True)
    with pytest.raises(ConfigError, match="^--enable-ep-moe: expert parallelism needs --tp-size > 1"):
        resolve(H100, V3_FP8, enable_ep_moe=True)


@pytest.mark.parametrize("argv, why", [
    (["--trust-remote-code"], "runs no code from the model folder"),
    (["--quantization", "fp8"], "does not quantize a bf16 checkpoint"),
    (["--enable-flashinfer-mla"], "its own Triton kernels"),
])
def test_sglang_flags_we_do_not_take_get_one_line_saying_why(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--tp", "8", *argv])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"mlaserve serve: error: {argv[0]}: ") and why in last
    name = argv[0][2:].replace("-", "_")                         # the Engine API's keyword: the same line
    with pytest.raises(TypeError, match=f"^{name}: .*{why}"):
        ServerConfig.from_flat(**{name: True})


def test_lpm_resolves_with_the_prefix_cache():
    assert resolve(CPU, schedule_policy="lpm").sched.schedule_policy == "lpm"
    assert resolve(CPU, disable_radix_cache=True).cache.disable_radix_cache


def test_http_only_flags_include_the_served_model_name():
    from mlaserve.config_resolve import http_only_flags

    assert http_only_flags(ServerConfig.from_flat(served_model_name="m", port=8000)) == ["--port",
                                                                                          "--served-model-name"]
    assert http_only_flags(ServerConfig.from_flat(tokenizer_path="/t")) == []
