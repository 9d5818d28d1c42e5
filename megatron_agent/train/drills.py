"""Fault drills behind one seam: a plan made once per worker from `debug.*`, and named hook
points that the workers call (docs/faults.md). With every `debug.*` field at its default the
plan is inactive and every hook point is a no-op.

Hook points (where a worker calls them):
- `around_update(model, batch, step)` (Megatron rank, around the PPO update): NaN logits at one
  token (`debug.nan_logits_*`).
- `reached(phase, step)` (rank 0 after its optimizer step: "update"; rank 0 while a checkpoint
  is staged: "save"; an engine inside its rollout: "rollout"): hold there until killed
  (`debug.hold_at`, train/kill_points.py).
- `engine_logits_processors()`, `turn_hook(tokenizer)` (rollout engine, at build): force the
  first assistant turn (`debug.forced_first_turn`).
- `around_rollout(engine, rank, greedy)` (rollout engine, around `generate`): the engine kills
  itself mid-rollout (`debug.kill_engine_at_step`).
The mechanics of each drill are in train/fault_injection.py and train/kill_points.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from megatron_agent.config import Config, DebugConfig


@dataclass(frozen=True)
class DrillPlan:
    """The drills of one run, from its `debug` section."""

    debug: DebugConfig
    run_dir: str

    @classmethod
    def from_config(cls, cfg: Config) -> DrillPlan:
        """The plan of `cfg.debug` (inactive when every field is at its default)."""
        return cls(debug=cfg.debug, run_dir=cfg.trainer.run_dir)


class Drills:
    """One worker's hook points (see the module docstring)."""

    def __init__(self, plan: DrillPlan):
        self.plan = plan

    def around_update(self, model, batch, step: int):
        """Context manager around the PPO update of `step` (NaN-logits drill)."""
        if not self.plan.debug.nan_logits_step:
            return contextlib.nullcontext()
        from megatron_agent.train.fault_injection import nan_logits

        return nan_logits(model, self.plan.debug, batch, step)

    def reached(self, phase: str, step: int) -> None:
        """Hold here forever when `debug.hold_at` names `phase:step` (resume drills)."""
        if self.plan.debug.hold_at:
            from megatron_agent.train.kill_points import hold_at

            hold_at(self.plan.debug.hold_at, self.plan.run_dir, phase, step)

    def engine_logits_processors(self) -> list:
        """vLLM logits processors the forced-turn drill needs (none when it is off)."""
        from megatron_agent.train.fault_injection import engine_logits_processors

        return engine_logits_processors(self.plan.debug)

    def turn_hook(self, tokenizer):
        """The agent loop's turn hook forcing `debug.forced_first_turn`, or None."""
        from megatron_agent.train.fault_injection import forced_turn_hook

        return forced_turn_hook(self.plan.debug, tokenizer)

    def around_rollout(self, engine, rank: int, greedy: bool):
        """Context manager around one `generate` call (engine-kill drill)."""
        if not self.plan.debug.kill_engine_at_step:
            return contextlib.nullcontext()
        from megatron_agent.train.fault_injection import kill_engine_mid_rollout

        return kill_engine_mid_rollout(self.plan.debug, engine, self.plan.run_dir, rank, greedy)
