"""Kill points: where a resume drill holds a run so that it can be killed in a chosen phase.

`debug.hold_at="PHASE:STEP"` (PHASE: rollout, update or save) makes the process that reaches
that point in RL step STEP write `<run_dir>/held_PHASE_STEP` and then sleep until it is killed:
- rollout: an engine, inside its rollout of the step (the driver waits in the rollout call);
- update: Megatron rank 0, after its optimizer step and before it reports it to the driver;
- save: Megatron rank 0, while the step's checkpoint is being staged (weights written, the
  manifest and the rename not yet done).
A drill (tests/train/test_deterministic_resume.py) then kills the whole run with SIGKILL and
resumes it; in deterministic mode the resumed run must repeat the uninterrupted one (tokens exactly, log-probs within 1e-5).
"""

from __future__ import annotations

import time
from pathlib import Path


def hold_at(target: str, run_dir: str | Path, phase: str, step: int) -> None:
    """Sleep forever here when `target` (`debug.hold_at`) is "phase:step" (a no-op otherwise)."""
    if not target or target != f"{phase}:{step}":
        return
    marker = Path(run_dir) / f"held_{phase}_{step}"
    marker.write_text(f"{phase} of step {step}: waiting to be killed\n")
    while True:
        time.sleep(1.0)
