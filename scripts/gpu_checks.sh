#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one call on a lent device machine: the Triton kernel,
# fused-op and CUDA engine tests, then benchmarks/gpu_decode.py and benchmarks/attention_kernels.py.
# Each stage has its own time limit so a slow one cannot starve the rest; everything is logged
# to $OUT/log.txt and the benchmarks write their JSON/PNG to $OUT.
#   usage: bash scripts/gpu_checks.sh [stage ...]
#   stages: tests suite decode kernels rule profile shapes heldout blas pipeline splits splitrule grid;
#   default: tests decode kernels.
#   `suite` runs the engine's tests with every engine on the GPU (scripts/cuda_suite.py);
#   `rule` runs the decode attention with its default launch rule (no sweep) on points the
#   rule was not read off; `profile` times each kernel inside the replayed decode graph;
#   `shapes` sweeps the attention at the decode benchmark's shapes; `heldout` sweeps head dim
#   128 at points no earlier sweep had; `blas` runs the decode benchmark's graphs under torch's
#   default BLAS choice and cuBLASLt, alternated; `pipeline` sweeps the attention's pipeline
#   stages (num_stages 1-4) at head dim 128 on the `heldout` points, decode path on; `splits`
#   sweeps the split count at head dim 128, batch 16 and 32, 4k and 16k with the decode path
#   (the batch-16 sweep above ran before it existed); `splitrule` sweeps split counts and key
#   tiles at points a candidate rule (3 waves; rejected, docs/benchmarks.md) was not read off
#   (head dim 128 and 64, 32/8 heads; qwen2-0.5b's 14/2); `grid` sweeps them on a grid of
#   batch sizes and contexts that none of those points share.
# The CPU kernels' tests (test_cpu_*.py) and test_engine_kernels.py's quantized-cache tests
# (device="cpu") are not run here: they are CPU code, tested in CI. On the H200 (2026-11-26
# 15:04) those CPU tests did not finish their setup in 120 s under 16 workers, while every GPU
# test passed in under 20 s each.
set -u
OUT=${OUT:-/tmp/kvh-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The device image has torch, triton and transformers but not pydantic (kvharbor.config needs
# it). Bring it as wheels in .whl/ (ignored by git; carry it), fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pydantic pydantic-core annotated-types \
#     typing-extensions typing-inspection
# (pydantic at the version of this checkout's venv: its core's version must match). The `suite`
# stage also wants ruamel.yaml (the CLI tests) and xgrammar with apache-tvm-ffi (structured
# output, spec decode); add --platform manylinux_2_28_x86_64 for those two. Without them their
# test modules fail to import and are reported as such. fastapi (with starlette, anyio, sniffio,
# idna, annotated-doc, opentelemetry-api) and jsonschema (with jsonschema-specifications,
# referencing, rpds-py, attrs) let three more engine modules collect; two import Ray, too big
# to carry, and run in CI only.
if ! python3 -c "import pydantic" 2>/dev/null; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "pydantic missing and no .whl/ to install it from"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
stages=${*:-tests decode kernels}
PYTEST=(python3 -m pytest -v -rfEw --tb=short -p no:cacheprovider -p no:benchmark --durations=12
        -o filterwarnings=ignore::DeprecationWarning -o addopts= -n 16 --timeout 120)
ASYNC=("test_stops_at_tokens_strings_and_lengths_match_steps_that_wait[cuda-kvharbor/tiny-llama]"
       "test_stops_at_tokens_strings_and_lengths_match_steps_that_wait[cuda-kvharbor/tiny-mistral]"
       "test_arrivals_and_aborts_mid_decode_match_steps_that_wait[cuda]"
       "test_a_full_pool_falls_back_to_scheduling_with_preemption[cuda]"
       "test_seeded_sampling_matches_steps_that_wait[cuda]"
       "test_logprobs_are_not_run_ahead[cuda]"
       "test_penalties_and_min_tokens_wait_for_the_token_in_flight[cuda]"
       "test_logit_bias_and_min_p_run_ahead[cuda]"
       "test_two_classes_decode_ahead_together_and_match_steps_that_wait[cuda-no-step-target]"
       "test_two_classes_decode_ahead_together_and_match_steps_that_wait[cuda-step-target-trims]"
       "test_the_next_step_is_launched_before_the_tokens_in_flight_are_read[cuda]")
GPU_TESTS=(tests/engine/test_greedy_exact.py::test_cuda_fp32_greedy_matches_transformers
           tests/engine/test_greedy_exact.py::test_cuda_bf16_greedy_agrees_with_transformers_bf16
           tests/kernels/test_triton_ops.py
           tests/kernels/test_paged_attention.py tests/kernels/test_store_kv.py
           tests/kernels/test_triton_backend.py
           tests/kernels/test_engine_kernels.py::test_triton_backend_generates_the_reference_tokens
           tests/kernels/test_compile_sm90.py
           # The CUDA variants only: the CPU ones are CI's, and under 16 workers on the device
           # three of them hit the 120 s timeout building their CPU engines (2026-11-27 03:06).
           "${ASYNC[@]/#/tests/engine/test_async_scheduling.py::}")
# The default rule on (batch, context) points the sweep below did not include (32, 48, 8192).
HELD_OUT=(--batch 16 32 48 --context 4096 8192 16384)
SWEEP=(--batch 16 64 --context 4096 16384 --sweep-splits 1 4 8 16 --sweep-block-n 64 128
       --sweep-warps 4 8)
# sweep TAG LIMIT ARGS...: benchmarks/attention_kernels.py with --tag TAG under a time limit; its PNG is
# dropped (a device call brings back at most 8 files; the JSON holds every timing).
sweep() {
  local tag=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/attention_kernels.py --out "$OUT" --tag "$tag" "$@" \
    && rm -f "$OUT/kernels_decode$tag.png"
}
{
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
  for s in $stages; do
    echo "=== $s $(date +%T)"
    case $s in
      # Every test's outcome stays in the log (the 2026-11-26 run filtered PASSED lines and
      # lost its pass list when the stage hit its limit); -n 16 and a per-test timeout so a
      # hung test is reported instead of eating the stage.
      tests) timeout ${TESTS_TIMEOUT:-200} "${PYTEST[@]}" --junitxml "$OUT/tests.xml" \
               ${TESTS:-"${GPU_TESTS[@]}"} ;;
      # The engine's CPU suite with every engine on the GPU in float32 (scripts/cuda_suite.py).
      # Modules whose imports the device lacks (Ray, xgrammar, ...) fail collection and are
      # listed as errors; the rest run. The CPU kernels' own tests are left to CI (above).
      suite) PYTHONPATH=scripts${PYTHONPATH:+:$PYTHONPATH} timeout ${SUITE_TIMEOUT:-300} \
               "${PYTEST[@]}" -p cuda_suite --continue-on-collection-errors \
               --junitxml "$OUT/suite.xml" tests/engine tests/kernels \
               --ignore-glob "tests/kernels/test_cpu_*.py" --ignore tests/kernels/test_inline_build.py ;;
      decode)
        for m in ${DECODE_MODELS:-llama-1b qwen2-0.5b}; do
          timeout ${DECODE_TIMEOUT:-55} python3 benchmarks/gpu_decode.py --model "$m" --tag "_$m" \
            --out "$OUT" ${DECODE_ARGS:-} 2>&1 | grep -v "it/s\]"
        done ;;
      kernels)
        timeout ${KERNELS_TIMEOUT:-50} python3 benchmarks/attention_kernels.py --out "$OUT" "${SWEEP[@]}"
        sweep _hd64 ${KERNELS_TIMEOUT:-50} --head-dim 64 "${SWEEP[@]}" ;;
      # GPU time per kernel inside the replayed batch-64 decode graph (torch.profiler).
      profile)
        timeout ${PROFILE_TIMEOUT:-150} python3 benchmarks/gpu_decode.py --model llama-1b qwen2-0.5b \
          --modes graphs --profile-replays 20 --tag _profile --out "$OUT" 2>&1 | grep -v "it/s\]" ;;
      # The decode attention at the decode benchmark's own shapes (batch 64, ~550 keys, head
      # dim 64): llama-1b's 32/8 heads and qwen2-0.5b's 14/2.
      shapes)
        sweep _shape_llama1b ${KERNELS_TIMEOUT:-50} --head-dim 64 --batch 64 --context 576 \
          --sweep-splits 1 2 4 --sweep-block-n 64 128 --sweep-warps 4
        sweep _shape_qwen05b ${KERNELS_TIMEOUT:-50} --head-dim 64 --q-heads 14 --kv-heads 2 \
          --batch 64 --context 576 --sweep-splits 1 2 4 8 --sweep-block-n 64 128 --sweep-warps 4 ;;
      # Head dim 128 at batch sizes and contexts that no earlier sweep had, every split count.
      heldout)
        sweep _heldout ${KERNELS_TIMEOUT:-80} --batch 8 24 40 --context 6144 12288 \
          --sweep-splits 1 2 4 8 16 --sweep-block-n 64 128 --sweep-warps 4 ;;
      blas)
        timeout ${BLAS_TIMEOUT:-150} python3 benchmarks/gpu_decode.py --model llama-1b qwen2-0.5b \
          --modes graphs --blas default cublaslt default cublaslt --profile-replays 10 \
          --tag _blas --out "$OUT" 2>&1 | grep -v "it/s\]" ;;
      pipeline)
        P=(--batch 8 24 40 --context 6144 12288 --sweep-warps 4 --sweep-stages 1 2 3 4
           --sweep-decode-only 1)
        sweep _pipeline ${KERNELS_TIMEOUT:-100} --sweep-splits 1 2 4 8 --sweep-block-n 128 "${P[@]}"
        sweep _pipeline_n64 ${KERNELS_TIMEOUT:-60} --sweep-splits 1 --sweep-block-n 64 "${P[@]}" ;;
      splits)
        sweep _splits ${KERNELS_TIMEOUT:-60} --batch 16 32 --context 4096 16384 \
          --sweep-splits 1 2 4 8 16 --sweep-block-n 128 --sweep-warps 4 --sweep-decode-only 1 ;;
      splitrule)
        SR=(--sweep-splits 1 2 4 8 16 --sweep-block-n 64 128 --sweep-warps 4 --sweep-decode-only 1)
        sweep _splitrule ${KERNELS_TIMEOUT:-110} --batch 12 20 28 56 64 --context 5120 10240 "${SR[@]}"
        sweep _splitrule_hd64 ${KERNELS_TIMEOUT:-60} --head-dim 64 --batch 20 48 \
          --context 5120 10240 "${SR[@]}"
        sweep _splitrule_qwen ${KERNELS_TIMEOUT:-40} --head-dim 64 --q-heads 14 --kv-heads 2 \
          --batch 16 32 --context 4096 "${SR[@]}" ;;
      grid)
        G=(--batch 4 10 14 22 30 44 60 80 --sweep-warps 4 --sweep-decode-only 1)
        sweep _grid_hd64 ${KERNELS_TIMEOUT:-120} --head-dim 64 --context 3072 8192 20480 \
          --sweep-splits 1 2 4 8 16 --sweep-block-n 128 "${G[@]}"
        for c in 3072 8192 20480; do
          sweep _grid_$c ${KERNELS_TIMEOUT:-120} --context $c --sweep-splits 1 2 4 8 16 \
            --sweep-block-n 64 128 "${G[@]}"
        done ;;
      rule)
        timeout ${KERNELS_TIMEOUT:-50} python3 benchmarks/attention_kernels.py --out "$OUT" --tag _rule \
          "${HELD_OUT[@]}"
        sweep _rule_hd64 ${KERNELS_TIMEOUT:-50} --head-dim 64 "${HELD_OUT[@]}" ;;
    esac
    echo "=== $s done $(date +%T)"
  done
} 2>&1 | tee "$OUT/log.txt"
