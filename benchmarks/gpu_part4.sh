#!/usr/bin/env bash
# Issue 26 §4 on a GPU in one command: host time per step and a profile, the Triton tile sweep,
# the calibration, the seeds' workload and the Batcher at SGLang's geometry and rate. Every part
# prints markdown and writes under $OUT (default /tmp/gpu-part4). On the device tool, whose
# commands stop at 10 minutes, run the parts one per call:
#
#     bash benchmarks/gpu_part4.sh all          # everything (about 25 minutes on an H100)
#     bash benchmarks/gpu_part4.sh host tiles   # or any of: host tiles calibrate workload serving
#
# The model is a random Qwen3-0.6B-shaped checkpoint in bfloat16 (`random_checkpoint.py`; the GPU
# machines have no default model), built once into $CHECKPOINT.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-part4}
checkpoint=${CHECKPOINT:-/tmp/qwen3-0.6b}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
parts=("$@")
[[ ${#parts[@]} -eq 0 || ${parts[0]} == all ]] && parts=(host tiles calibrate workload serving)
python -c "import sys; sys.path.insert(0, 'benchmarks'); from random_checkpoint import qwen3_0_6b
qwen3_0_6b('$checkpoint', dtype='bfloat16')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt" || true

for part in "${parts[@]}"; do
  echo "== $part: $(date -u +%H:%M:%S)"
  case $part in
    host)  # target: under 0.5 ms of host time per step
      python benchmarks/host_overhead.py --gpu --checkpoint "$checkpoint" --trace "$out/trace" \
        | tee "$out/host_overhead.md" ;;
    tiles)  # the best tiles per head dim and dtype, kept for this GPU kind
      python benchmarks/triton_sweep.py --write --json "$out/triton_sweep.json" \
        | tee "$out/triton_sweep.md"
      cp src/tpuscore/kernels/segment/gpu_tiles.json "$out/" ;;
    calibrate)  # the profile as measured: commit it as src/tpuscore/engine/profiles/h100.json
      python -m tpuscore.cli.calibrate --model "$checkpoint" --dtype bfloat16 \
        --out "$out/profile.json" --measurements "$out/calibration.json" \
        | tee "$out/calibration.md" || echo "calibrate: the held-out check failed (see the table)" ;;
    workload)  # target: >= 15,000 items/s on the seeds' workload (2000 + 500 x 20)
      python benchmarks/gpu_backends.py --checkpoint "$checkpoint" --repeats 5 \
        | tee "$out/workload.md" ;;
    serving)  # target: >= 5,000 items/s through the Batcher, P99 < 100 ms at 120 requests/s
      python benchmarks/serving.py --gpu --checkpoint "$checkpoint" --rate 120 --duration 20 \
        --backend packed_segment --skip-hf | tee "$out/serving.md" ;;
    *) echo "unknown part $part (host tiles calibrate workload serving all)" >&2; exit 2 ;;
  esac
done
echo "== done: $(date -u +%H:%M:%S); results in $out"
