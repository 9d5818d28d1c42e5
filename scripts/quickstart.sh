#!/usr/bin/env bash
# The main job on CPU. Until the RL trainer lands this scores chat-formatted token ids with a tiny
# Qwen2-style model on Megatron-core at TP=2 (two gloo ranks) and checks the result against TP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/quickstart}
PY=.venv/bin/python
mkdir -p "$RUN_DIR"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
$PY examples/make_score_inputs.py "$RUN_DIR"
$PY -m torch.distributed.run --nproc_per_node 2 -m megatron_agent score \
  --model "$RUN_DIR/model" --data "$RUN_DIR/score_in.jsonl" --out "$RUN_DIR/score_tp2.jsonl" --tp 2
$PY -m megatron_agent score --model "$RUN_DIR/model" --data "$RUN_DIR/score_in.jsonl" --out "$RUN_DIR/score_tp1.jsonl"
$PY - "$RUN_DIR" <<'PYEOF'
import json, sys
run = sys.argv[1]
tp2 = [json.loads(l)["logprobs"] for l in open(f"{run}/score_tp2.jsonl")]
tp1 = [json.loads(l)["logprobs"] for l in open(f"{run}/score_tp1.jsonl")]
diff = max(abs(a - b) for x, y in zip(tp1, tp2) for a, b in zip(x, y))
tokens = sum(len(x) for x in tp1)
mean = sum(sum(x) for x in tp1) / tokens
print(f"scored {len(tp1)} sequences, {tokens} tokens: mean log-prob {mean:.4f}; max |TP2 - TP1| = {diff:.2e}")
sys.exit(0 if diff < 1e-5 else 1)
PYEOF
