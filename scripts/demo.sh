#!/usr/bin/env bash
# Sets everything up, then shows ckptio's core promise: a run is interrupted, rerun, and resumes
# exactly where it stopped (same final loss as a run that was never interrupted).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
PY=.venv/bin/python
OUT=runs/demo
rm -rf "$OUT" && mkdir -p "$OUT"
echo; echo "== 1. train, interrupted after step 15 (checkpoints every 5 steps)"
$PY examples/resume_demo.py --checkpoint-dir "$OUT/ckpt" --max-steps 30 --stop-at 15
echo; echo "== 2. rerun the same command: it finds the newest complete checkpoint and resumes"
$PY examples/resume_demo.py --checkpoint-dir "$OUT/ckpt" --max-steps 30 --report "$OUT/resumed.json"
echo; echo "== 3. reference: the same 30 steps without interruption"
$PY examples/resume_demo.py --checkpoint-dir "$OUT/straight" --max-steps 30 --report "$OUT/straight.json" | tail -1
echo; echo "== 4. what is on disk"
.venv/bin/ckptio list "$OUT/ckpt"
echo
.venv/bin/ckptio inspect "$OUT/ckpt/LATEST"
echo
$PY - "$OUT" <<'PYEOF'
import json, sys
a = json.load(open(f"{sys.argv[1]}/resumed.json")); b = json.load(open(f"{sys.argv[1]}/straight.json"))
same = a == b
print(f"== 5. resumed run final loss {a['loss']:.6f} vs uninterrupted {b['loss']:.6f}: "
      + ("bitwise identical" if same else "DIFFERENT"))
sys.exit(0 if same else 1)
PYEOF
