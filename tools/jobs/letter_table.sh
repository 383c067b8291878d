#!/usr/bin/env bash
# The intuitive-physics letter table over seeds 1-3 side by side on one GPU (issue #45 item 3), as a device job:
#   source .device-wheels/setup.sh; bash tools/device_job.sh start letters tools/jobs/letter_table.sh [EXTRA ARGS]
# EXTRA ARGS go to every `physreason experiment intuitive-physics` call (none: the recipe, the tower's head on every
# token and 3,000 SFT steps; e.g. `--tower-head time --sft-steps 1500` for the earlier one). Writes each seed's log
# and table, then the combined table, to $RESULTS as they finish.
set -u
IP="--stop-after sft --out /tmp/letters $*"
OUT= python3 -m physreason experiment intuitive-physics $IP --workers 15 --stop-after data > "$RESULTS/data.log" 2>&1 || exit 1
export PHYSREASON_HOST_PROCESSES=3
for s in 1 2 3; do
    OUT= timeout 1100 python3 -m physreason experiment intuitive-physics $IP --workers 4 --seeds $s > "$RESULTS/seed$s.log" 2>&1 &
done
wait
unset PHYSREASON_HOST_PROCESSES
find /tmp/letters -name 'table*-seeds?.*' -exec cp {} "$RESULTS/" \;
OUT= python3 -m physreason experiment intuitive-physics --combine $(find /tmp/letters -name 'table*-seeds?.json' | sort) \
    > "$RESULTS/combined.log" 2>&1
tail -n 12 "$RESULTS/combined.log"
