#!/usr/bin/env bash
# The main job on CPU: the quickstart RL run (examples/quickstart/config.yaml) with the embedded
# defaults. A tiny model and tokenizer are made from nothing, SFT'd on synthetic calculator
# demonstrations, then trained with GRPO and the calculator tool; validation accuracy is printed
# in the table and plotted in <run_dir>/metrics.png.
#   bash scripts/quickstart.sh [RUN_DIR] [key=value ...]     e.g. trainer.total_steps=3
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/quickstart}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m megatron_agent train --config examples/quickstart/config.yaml \
  "trainer.run_dir=$RUN_DIR" "$@"
