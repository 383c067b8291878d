#!/usr/bin/env bash
# GRPO with FP8 rollouts against bf16 rollouts, both on vLLM, over seeds 1-4 (issue #47 item 3: the reward curve
# within bf16's seed spread), as a device job on a machine of 2 GPUs, two seeds a GPU side by side:
#   export PYTHONPATH=/tmp/site:$PWD ...; bash tools/device_job.sh start gfp8 tools/jobs/grounding_fp8.sh [EXTRA ARGS]
# (vLLM and .device-wheels installed into /tmp/site first, bench/PENDING.md 7f.) EXTRA ARGS go to every
# `physreason experiment grounding` call after the job's own (a CPU check: the docstring's toy sizes with
# `--variants grpo` only, as FP8 needs CUDA). GPUS (default 2) and SEEDS (default "1 2 3 4") change the layout.
# Each seed's log and table, then the combined table, go to $RESULTS as they finish.
set -u
A="--train-per-task 1000 --rl-per-task 500 --test-per-task 150 --sft-steps 300 --grpo-steps 40 --ckpt-every 1000
   --out /tmp/gfp8 --rollout-engine vllm --rollout-gpu-memory 0.15 --rollout-kv-cache-gib 2
   --variants grpo grpo-fp8:rollout-quantization=fp8 $*"
gpus=${GPUS:-2}
seeds=(${SEEDS:-1 2 3 4})
OUT= python3 -m physreason experiment grounding $A --workers 15 --stop-after data > "$RESULTS/data.log" 2>&1 || exit 1
export PHYSREASON_HOST_PROCESSES=${#seeds[@]}  # every seed shares the host CPUs (physreason/cpu.py)
k=0
for s in "${seeds[@]}"; do
    CUDA_VISIBLE_DEVICES=$((k % gpus)) OUT= timeout 1500 python3 -m physreason experiment grounding $A --workers 4 \
        --seeds "$s" > "$RESULTS/seed$s.log" 2>&1 &
    k=$((k + 1))
done
wait
unset PHYSREASON_HOST_PROCESSES
find /tmp/gfp8 -name 'grounding*-seeds?.*' -exec cp {} "$RESULTS/" \;
grep -h "GRPO mean reward" "$RESULTS"/seed*.log > "$RESULTS/rewards.txt"
OUT= python3 -m physreason experiment grounding --combine $(find /tmp/gfp8 -name 'grounding*-seeds?.json' | sort) \
    > "$RESULTS/combined.log" 2>&1
tail -n 14 "$RESULTS/combined.log"
