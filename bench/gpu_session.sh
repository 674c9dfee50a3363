#!/usr/bin/env bash
# One command for a session that is lent a GPU (issue 45's acceptance measurements), sized for
# the device tool's lease: about 8 minutes on one H200 after the project is installed, leaving
# time for a rerun. Everything it prints goes to one log, tarred into $OUT (the tool returns at
# most 8 files). Run it on the device machine from the repository root:
#
#     bash bench/gpu_session.sh            # on the GPU machine (OUT set by the device tool)
#     GPU_SESSION_TINY=1 OUT=/tmp/o bash bench/gpu_session.sh   # CPU dry run of every step, here
#
# Steps, each with its own time limit so that one stuck step cannot eat the lease:
#   1. install the project (no dependencies, no build isolation: the machine has no network);
#   2. the gpu-marked tests (the only tests that skip on CPU);
#   3. bench/bench_gpu.py: plain, FSDP2 and ZeRO-1/2/3 on a 0.94B Llama in one process: step
#      time, ratios to plain and FSDP2, peak memory, host syncs per step, losses against plain;
#   4. bench/bench_muon.py at one rank on the GPU (Newton-Schulz time on the device, parity);
#   5. a dropped engine's memory freed without gc.collect() (tests/faults/test_refcount_free.py
#      runs on the model's device).
set -uo pipefail
OUT=${OUT:?set OUT to the folder whose files come back}
LOG="$OUT/gpu_session"
mkdir -p "$LOG"
TINY=${GPU_SESSION_TINY:-}
export PYTHONPATH=".:integrations${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log it, never stop the script
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$LOG/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  echo "    rc=$rc after $((SECONDS - t0))s" | tee -a "$LOG/summary.txt"
  tail -25 "$LOG/$name.log" >>"$LOG/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} >"$LOG/machine.txt" 2>&1

if [ -z "$TINY" ]; then
  step install 240 python -m pip install -q --no-deps --no-build-isolation .
  # only the files that hold gpu tests: others import trl or deepspeed, which that machine lacks
  step gpu_tests 150 python -m pytest -q -m gpu -p no:cacheprovider $(grep -rl "mark.gpu" tests --include="test_*.py")
  step bench_gpu 300 python bench/bench_gpu.py --sizes 0.94b --rows plain,fsdp2,zero1,zero2,zero3
  step bench_muon 150 python bench/bench_muon.py --ranks 1 --json "$LOG/bench_muon.json"
  step refcount 120 python -m pytest -q -p no:cacheprovider tests/faults/test_refcount_free.py
else  # the same steps, small, on CPU: checks the script itself
  step gpu_tests 120 python -m pytest -q -m gpu -p no:cacheprovider $(grep -rl "mark.gpu" tests --include="test_*.py")
  step bench_gpu 300 python bench/bench_gpu.py --tiny
  step bench_muon 300 python bench/bench_muon.py --tiny --ranks 1 --json "$LOG/bench_muon.json"
fi
tar -czf "$OUT/gpu_session.tgz" -C "$OUT" gpu_session && rm -rf "$LOG"
echo "logs: $OUT/gpu_session.tgz"
