# Call C (4 GPUs, vLLM + Ray in /tmp/site): GRPO colocated on 4 GPUs against disaggregated 2+2 and 1+3.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
L=$OUT/c.log; nvidia-smi -L > $L; date >> $L
timeout ${C_LIMIT:-570} python3 bench/rl_disaggregated.py --gpus 4 --modes disaggregated colocated --layouts 2+2,1+3 --out /tmp/rl-bench --steps 6 --warmup 2 --time-limit $(( ${C_LIMIT:-570} - 15 )) 2>&1 | grep -v -i warn | tail -30 >> $L
cp /tmp/rl-bench/results.json $OUT/rl4.json 2>/dev/null
for f in /tmp/rl-bench/*.log; do echo "===== $f"; grep -v -i warn $f | tail -15; done >> $L 2>&1; date >> $L
