#!/usr/bin/env bash
# float8's 200-step loss curve against bf16's over seeds 0-2 (issue #46 goal 1, second half), as a device job:
#   source .device-wheels/setup.sh; bash tools/device_job.sh start fp8curve tools/jobs/fp8_curve.sh [RECIPE [ARG...]]
# RECIPE: the float8 run's quant_recipe (default tensorwise); ARGs go to every `bench/fp8.py curve` call after the
# job's own (a CPU check: `tensorwise --tiny --steps 4`). One seed after another, sharing --out, so the clips are
# made once (about 100 s on an H200's 16 cores); each seed is a bf16 and a float8 SFT run of about 100 s each there
# (2026-11-28: a 165 s limit a seed killed every float8 run). Each seed's JSON and log go to $RESULTS as it ends.
set -u
recipe=${1:-tensorwise}
shift || true
out=${FP8_CURVE_OUT:-/tmp/fp8-curve}
for s in 0 1 2; do
    timeout -k 10 400 python3 bench/fp8.py curve --recipe "$recipe" --seed $s --steps 200 --out "$out" "$@" \
        > "$RESULTS/seed$s.log" 2>&1
    echo "seed $s rc=$?" >> "$RESULTS/status.txt"
    cp "$out/fp8_curve.json" "$RESULTS/fp8_curve_seed$s.json" 2>/dev/null
    rm -f "$out/fp8_curve.json"
done
cat "$RESULTS/status.txt"
