#!/usr/bin/env bash
# Sets everything up, then runs the fine-tuning recipe the way a user lives it: training is preempted
# part-way (SIGTERM), the same command is rerun and resumes, and the result is loaded with transformers
# (and, for LoRA, with peft) to generate a line of text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python
OUT=runs/demo
rm -rf "$OUT" && mkdir -p "$OUT"
RUN=(examples/llm/finetune.py --config examples/llm/tiny_llama.yaml
     --checkpoint.checkpoint_dir "$OUT/checkpoints" --step_scheduler.max_steps 200 --step_scheduler.ckpt_every_steps 50)

echo; echo "== 1. fine-tune a tiny Llama (200 steps); it gets preempted (SIGTERM) after its checkpoint at step 100"
"$PY" "${RUN[@]}" > "$OUT/part1.log" 2>&1 &
pid=$!
until grep -q "Saved checkpoint .*epoch_0_step_100" "$OUT/part1.log" 2>/dev/null; do
  kill -0 "$pid" 2>/dev/null || { cat "$OUT/part1.log"; echo "the first run ended early" >&2; exit 1; }
  sleep 0.2
done
kill -TERM "$pid"
wait "$pid" || true
grep -v "^Config" "$OUT/part1.log"

echo; echo "== 2. rerun the same command: it resumes from the newest complete checkpoint"
"$PY" "${RUN[@]}" 2>&1 | grep -v "^Config"

echo; echo "== 3. what is on disk"
.venv/bin/ckptio list "$OUT/checkpoints"

echo; echo "== 4. load the consolidated bundle with transformers and generate"
"$PY" examples/llm/generate.py "$OUT/checkpoints/epoch_0_step_200/model/consolidated"

echo; echo "== 5. LoRA on top of that model (loaded from the bundle as a pretrained folder); load the adapter with peft"
"$PY" examples/llm/finetune.py --config examples/llm/tiny_llama_peft.yaml --checkpoint.checkpoint_dir "$OUT/peft" \
  --model.pretrained_path "$OUT/checkpoints/epoch_0_step_200/model/consolidated" \
  --step_scheduler.max_steps 50 2>&1 | grep -v "^Config" | tail -4
"$PY" examples/llm/generate.py "$OUT/peft/epoch_0_step_50/model"

echo; echo "== 6. quantized export for TensorRT-LLM (int8 weight-only, split for 2-way tensor parallelism), checked"
.venv/bin/ckptio quantize "$OUT/checkpoints/epoch_0_step_200/model/consolidated" "$OUT/model.qnemo" --tp 2 --compress
echo; echo "Demo complete: checkpoints under $OUT"
