#!/usr/bin/env bash
# Issue 26 §4 on a GPU in one command: the seeds' workload, the Batcher at SGLang's geometry, host
# time per step with a profile, the Triton tile sweep and the calibration. Everything printed goes
# to $OUT/part4.log (markdown); the trace, the tiles and the profile are files beside it.
#
#     bash benchmarks/gpu_part4.sh all          # everything, inside $BUDGET_S (default 560 s)
#     bash benchmarks/gpu_part4.sh host tiles   # or any of: workload serving host tiles tuned
#                                               # launch unrolled modeltiles serving-unrolled
#                                               # trace serving-big int8 calibrate
#
# The device tool stops a command at 10 minutes and lends 15 minutes a session, so each part has
# its own time limit and the calibration takes what is left of BUDGET_S (it fits and checks on the
# points it timed). A part that fails or runs out of time leaves the others running. Every part
# shares one persistent compilation cache, so a shape compiled by one part is not compiled again.
#
# The model is a random Qwen3-0.6B-shaped checkpoint in bfloat16 (`random_checkpoint.py`; the GPU
# machines have no default model), built once into $CHECKPOINT. They have no `gguf` either: carry
# its wheel and put it on PYTHONPATH (docs/benchmarks.md shows the device command).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-part4}
checkpoint=${CHECKPOINT:-/tmp/qwen3-0.6b}
end=$((SECONDS + ${BUDGET_S:-560}))
mkdir -p "$out"
log="$out/part4.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.2
parts=("$@")
[[ ${#parts[@]} -eq 0 || ${parts[0]} == all ]] && parts=(workload serving host tiles tuned launch unrolled modeltiles serving-unrolled trace serving-big int8 calibrate)
python -c "import sys; sys.path.insert(0, 'benchmarks'); from random_checkpoint import qwen3_0_6b
qwen3_0_6b('$checkpoint', dtype='bfloat16')" 2>&1 | tail -1 | tee -a "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"

# run SECONDS COMMAND...: the command under a time limit (never past the budget), logged.
run() {
  local limit=$(($1 < end - SECONDS ? $1 : end - SECONDS))
  shift
  ((limit > 10)) || { echo "skipped (budget spent): $*" | tee -a "$log"; return; }
  echo "\$ $* (limit ${limit} s)" | tee -a "$log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
}

for part in "${parts[@]}"; do
  echo -e "\n== $part: $(date -u +%H:%M:%S), $((end - SECONDS)) s of the budget left" | tee -a "$log"
  case $part in
    workload)  # target: >= 15,000 items/s on the seeds' workload (2000 + 500 x 20)
      run 120 python benchmarks/gpu_backends.py --checkpoint "$checkpoint" --repeats 5 --no-hf \
        --backends packed_dense,packed_segment,prefill_extend ;;
    serving)  # target: >= 5,000 items/s through the Batcher, P99 < 100 ms at 120 requests/s
      run 110 python benchmarks/serving.py --gpu --checkpoint "$checkpoint" --rate 120,500 \
        --duration 10 --backend packed_segment --skip-hf --skip-threads ;;
    host)  # target: under 0.5 ms of host time per step; a jax.profiler trace per backend
      run 100 python benchmarks/host_overhead.py --gpu --checkpoint "$checkpoint" --repeats 3 \
        --trace /tmp/trace
      tar -czf "$out/trace.tgz" -C /tmp trace 2>/dev/null || true ;;
    tiles)  # the best tiles for Qwen3's head dim in bfloat16, kept for this GPU kind
      run 120 python benchmarks/triton_sweep.py --head-dims 128 --dtypes bfloat16 \
        --layouts long,sglang --tiles 32,64,128 --budget-s 100 --repeats 5 --write \
        --json "$out/triton_sweep.json"
      cp src/tpuscore/kernels/segment/gpu_tiles.json "$out/" ;;
    tuned)  # packed_segment again, on the tiles the sweep kept
      run 60 python benchmarks/gpu_backends.py --checkpoint "$checkpoint" --repeats 5 --no-hf \
        --backends packed_segment ;;
    launch)  # the step's launch: host ms per step at SGLang's and the seeds' geometry, the layer
      # loop rolled (XLA's while loop: each layer's kernels issued from the host), unrolled
      # (decoder.UNROLLED_LAYERS_ON), and rolled under XLA's command buffers (CUDA graphs)
      # extended to the while loop; a flag this XLA does not know stops its run at start
      for variant in "rolled||" "unrolled|cuda|" "while-graphs||--xla_gpu_enable_command_buffer=+WHILE"; do
        IFS='|' read -r name unroll flags <<<"$variant"
        echo "### $name" | tee -a "$log"
        XLA_FLAGS="$flags" run 70 python benchmarks/host_overhead.py --gpu --checkpoint \
          "$checkpoint" --geometry sglang --geometry long --backends packed_segment --repeats 5 \
          --unroll-layers "$unroll"
      done ;;
    unrolled)  # the seeds' workload and the other geometries with the layer loop unrolled
      run 110 python benchmarks/gpu_backends.py --checkpoint "$checkpoint" --repeats 5 --no-hf \
        --backends packed_segment,prefill_extend --unroll-layers cuda ;;
    modeltiles)  # the segment kernel's tiles swept inside the whole packed_segment call
      run 120 python benchmarks/gpu_model_tiles.py --checkpoint "$checkpoint" --budget-s 85 \
        --repeats 3 --write --json "$out/model_tiles.json"
      cp src/tpuscore/kernels/segment/gpu_tiles.json "$out/" ;;
    serving-unrolled)  # the Batcher at SGLang's geometry, the layer loop unrolled
      run 70 python benchmarks/serving.py --gpu --checkpoint "$checkpoint" --rate 120,500 \
        --duration 8 --backend packed_segment --skip-hf --skip-threads --unroll-layers cuda ;;
    trace)  # where the step's time goes: matmuls, the segment kernel, other fusions
      for geometry in 2000,500,20 300,10,10; do
        run 60 python benchmarks/step_trace.py bfloat16 "$geometry" --gpu --checkpoint \
          "$checkpoint" --top 15
      done ;;
    serving-big)  # the Batcher saturated, with batches of 4x the default tokens
      run 100 python benchmarks/serving.py --gpu --checkpoint "$checkpoint" --rate 500 \
        --duration 8 --backend packed_segment --skip-hf --skip-threads --max-batch-tokens 32768 ;;
    int8)  # why int8 is wrong on a GPU: each piece of models/int8.py against the host's CPU
      run 60 python benchmarks/gpu_int8_checks.py ;;
    calibrate)  # the profile as measured: commit it as src/tpuscore/engine/profiles/<gpu>.json
      left=$((end - SECONDS))
      run "$left" python -m tpuscore.cli.calibrate --model "$checkpoint" --dtype bfloat16 \
        --budget-s $((left - 90)) --out "$out/profile.json" \
        --measurements "$out/calibration.json" ;;
    *) echo "unknown part $part (workload serving host tiles tuned launch unrolled modeltiles serving-unrolled trace serving-big int8 calibrate all)" >&2; exit 2 ;;
  esac
done
echo "== done: $(date -u +%H:%M:%S); results in $out" | tee -a "$log"
