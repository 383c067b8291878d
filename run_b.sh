# Call B (4 GPUs, started under setsid from /tmp/repo): the grounding experiment, four seeds one a GPU, same clips.
export PYTHONPATH=/tmp/site0:$PWD PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda
mkdir -p /tmp/outb; L=/tmp/outb/b.log; nvidia-smi -L > $L; nproc >> $L; date >> $L
A="--train-per-task 1000 --rl-per-task 500 --test-per-task 150 --sft-steps 300 --grpo-steps 60 --ckpt-every 1000 --out /tmp/g --variants grpo grpo-mix:iou-hit-weight=0.5"
OUT= timeout 150 python3 -m physreason experiment grounding $A --workers 60 --stop-after data > /tmp/g0.log 2>&1; echo "data rc $? $(date)" >> $L
for s in 1 2 3 4; do (CUDA_VISIBLE_DEVICES=$((s - 1)) OUT= timeout 700 python3 -m physreason experiment grounding $A --workers 14 --seeds $s > /tmp/g$s.log 2>&1; echo "seed $s rc $? $(date)" >> $L) & done; wait
OUT=/tmp/outb python3 -m physreason experiment grounding --combine /tmp/g/qwen2_5_vl/grounding-*-seeds?.json >> $L 2>&1
cp /tmp/g/qwen2_5_vl/grounding-combined.* /tmp/outb/ 2>/dev/null
for s in 0 1 2 3 4; do echo "=== log $s"; grep -v -i warn /tmp/g$s.log | tail -40; done >> $L
python3 - >> $L 2>&1 <<'PY'
import glob, json, statistics
for f in sorted(glob.glob('/tmp/g/**/metrics.jsonl', recursive=True)):
    rows = [json.loads(l) for l in open(f) if l.strip()]
    st = [r['time/step_s'] for r in rows if 'time/step_s' in r]
    gen = [r['time/generate_s'] for r in rows if 'time/generate_s' in r]
    if st: print(f, len(st), 'steps; median step_s', round(statistics.median(st), 3), 'generate_s', round(statistics.median(gen), 3) if gen else None, 'reward first/last', rows[0].get('reward/total_mean'), rows[-1].get('reward/total_mean'))
PY
echo "seeds summarised $(date)" >> $L
[ $SECONDS -lt ${EVAL_BEFORE:-450} ] && (OUT=/tmp/outb timeout 240 python3 bench/eval_scaling.py --gpus 1 4 --clips 32 --max-tokens 64 --rounds 1 --work /tmp/es1 2>&1 | grep -E '^\{|rror|Traceback' | tail -8) >> $L 2>&1
echo "B finished $(date)" >> $L; touch /tmp/outb/DONE
