#!/usr/bin/env bash
# One prepared GPU check, sized to finish in under 8 minutes on one GPU.
#
# Prints JSON lines (one per case, see benchmarks/gpu_check.py for the fields):
#   * PaiNN and MACE training-step time in float32 and bf16, eager and compiled
#     (TrainingStrategy(compile=True)); a model torch.compile cannot train says why;
#   * the batched neighbour-list builder on the device, and whether its lists equal
#     the CPU's;
#   * host-device synchronisations in one profiled step (lists precomputed, and built
#     by the strategy on the device);
#   * `nvalchemi-training bench` when this build has it.
# Each case runs in its own process under a timeout; cases that would overrun the
# total budget are skipped with a line saying so. Exits 0 whatever a case reports.
# On a machine without CUDA it says so and runs the CPU cases at small sizes.
#
# Usage: benchmarks/gpu_check.sh            (PYTHON=... to choose the interpreter)
#        BUDGET_S=450 benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET_S="${BUDGET_S:-450}"
START=$SECONDS

line() { printf '%s\n' "$1"; }

CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
line "{\"check\": \"environment\", \"cuda\": $([ "$CUDA" = 1 ] && echo true || echo false), \"python\": \"$("$PY" -c 'import sys; print(sys.version.split()[0])')\", \"torch\": \"$("$PY" -c 'import torch; print(torch.__version__)')\", \"budget_s\": $BUDGET_S}"

# name and timeout (s) of each case, most important first
if [ "$CUDA" = 1 ]; then
    DEVICE=cuda
    CASES="step:painn:float32:eager=45 step:painn:bf16:eager=45 neighbors=40 syncs=60
step:painn:float32:compiled=120 step:mace:float32:eager=60 step:mace:bf16:eager=60
step:painn:bf16:compiled=120 step:mace:float32:compiled=90 step:mace:bf16:compiled=90"
else
    DEVICE=cpu
    line '{"check": "cuda", "available": false, "note": "CUDA is absent: the CPU cases run at small sizes (4-atom cells, 4 per batch); the GPU numbers need a CUDA machine"}'
    CASES="step:painn:float32:eager=60 step:painn:bf16:eager=60 neighbors=40 syncs=20
step:painn:float32:compiled=150 step:mace:float32:eager=90"
fi

for entry in $CASES; do
    name="${entry%=*}"
    limit="${entry##*=}"
    left=$((BUDGET_S - (SECONDS - START)))
    if [ "$left" -lt "$limit" ]; then
        line "{\"check\": \"${name%%:*}\", \"case\": \"$name\", \"status\": \"skipped\", \"reason\": \"time budget: ${left} s left, the case may take ${limit} s\"}"
        continue
    fi
    out=$(timeout "$limit" "$PY" benchmarks/gpu_check.py --case "$name" --device "$DEVICE" 2>/dev/null)
    code=$?
    out=$(printf '%s\n' "$out" | tail -n 1)
    if [ -n "$out" ] && [ "${out:0:1}" = "{" ]; then
        line "$out"
    elif [ "$code" = 124 ]; then
        line "{\"check\": \"${name%%:*}\", \"case\": \"$name\", \"status\": \"timeout\", \"reason\": \"did not finish within ${limit} s\"}"
    else
        line "{\"check\": \"${name%%:*}\", \"case\": \"$name\", \"status\": \"error\", \"reason\": \"exit code $code and no result line\"}"
    fi
done

# the bench command (another part of the project; absent from older builds)
left=$((BUDGET_S - (SECONDS - START)))
if ! "$PY" -m nvalchemi.training.cli bench --help >/dev/null 2>&1; then
    line '{"check": "bench", "status": "skipped", "reason": "this build has no `nvalchemi-training bench` command"}'
elif [ "$left" -lt 60 ]; then
    line "{\"check\": \"bench\", \"status\": \"skipped\", \"reason\": \"time budget: ${left} s left\"}"
else
    args="--model painn --steps 20 --warmup 3 --device $DEVICE --json"
    if [ "$CUDA" = 1 ]; then args="$args --precision bf16"; fi
    json=$(timeout $((left - 5)) "$PY" -m nvalchemi.training.cli bench $args 2>/dev/null)
    code=$?
    if [ "$code" = 0 ] && [ -n "$json" ]; then
        printf '%s' "$json" | "$PY" -c 'import json, sys; print(json.dumps({"check": "bench", **json.load(sys.stdin)}))' \
            || line '{"check": "bench", "status": "error", "reason": "unreadable JSON"}'
    else
        line "{\"check\": \"bench\", \"status\": \"error\", \"reason\": \"exit code $code\"}"
    fi
fi
line "{\"check\": \"done\", \"wall_s\": $((SECONDS - START))}"
exit 0
