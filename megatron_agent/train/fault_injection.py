"""Fault drills: faults injected on purpose through the `debug` config section (docs/faults.md).
The workers reach them through one seam, `train/drills.py`.

- `nan_logits`: during the PPO update of RL step `debug.nan_logits_step`, the actor's logits at
  one token are NaN: the logits that predict response token `debug.nan_logits_token` of the
  step's trajectory `debug.nan_logits_sample` (its line in `rollouts/step_N.jsonl`). The hidden
  state fed to the output layer at that position is set to NaN on the last pipeline stage (every
  TP rank), so the whole logits row there is NaN, the log-prob of that token is NaN, and the
  backward pass puts NaN into the output layer's gradient: what a numerical blow-up in the head
  looks like. Every forward of the update at that step that holds the trajectory is hit (every
  PPO epoch); the log-prob pass before the update is not.
- `forced_turn_hook` / `engine_logits_processors`: the engines emit `debug.forced_first_turn` as
  every trajectory's first assistant turn (the model's own log-probs are still recorded), so that
  a tiny random model calls the tools a drill needs.
- `kill_engine_mid_rollout`: at RL step `debug.kill_engine_at_step`, rollout engine 0's process
  kills itself (SIGKILL) in the middle of its rollout; the trainer replaces it
  (`Trainer.rollout`), once per run folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

import torch

logger = logging.getLogger("megatron_agent.train")


def nan_target(debug, batch, step: int) -> tuple[list[int], int] | None:
    """(sequence ids, target index) that `debug` poisons at `step`, or None when nothing is due.

    Target j is predicted by the logits at position j (it predicts id j + 1). Response token k
    of a trajectory is target `len(prompt) - 1 + k`; the first response token is always
    engine-sampled, so the prompt ends where the loss mask first turns on.
    """
    if not debug.nan_logits_step or step != debug.nan_logits_step:
        return None
    sample, token = debug.nan_logits_sample, debug.nan_logits_token
    if not 0 <= sample < len(batch):
        raise ValueError(
            f"debug.nan_logits_sample={sample}: step {step} has {len(batch)} trajectories (0..{len(batch) - 1})"
        )
    mask = batch.tensors["loss_mask"][sample]
    first = int(mask.nonzero()[0]) if mask.any() else len(mask)
    target = first + token
    if not 0 <= token or target >= len(mask):
        raise ValueError(
            f"debug.nan_logits_token={token}: trajectory {batch.uids[sample]} of step {step} has "
            f"{len(mask) - first} response tokens"
        )
    return list(batch.sequences[sample]), target


@contextlib.contextmanager
def nan_logits(model, debug, batch, step: int):
    """Within the block, NaN logits at `nan_target(debug, batch, step)` in `model`'s forwards.

    `model`: a `MegatronModel`; only the last pipeline stage's chunk computes logits. A no-op
    when no injection is due at `step`.
    """
    due = nan_target(debug, batch, step)
    last = _last_stage_model(model) if due is not None else None
    if last is None:
        yield
        return
    sequence, target = due
    seq_S = torch.tensor(sequence, dtype=torch.long)
    hits = []

    def pre_hook(module, args, kwargs):
        input_ids_BS = args[0] if args else kwargs["input_ids"]
        rows = _matching_rows(input_ids_BS, seq_S)
        processor = kwargs.get("output_processor")
        if not rows or processor is None:
            return None

        def poisoned(hidden_states, **rest):
            hidden_SBH = hidden_states.clone()
            hidden_SBH[target, rows] = float("nan")
            return processor(hidden_states=hidden_SBH, **rest)

        hits.append(rows)
        return args, {**kwargs, "output_processor": poisoned}

    handle = last.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
    if hits:
        logger.warning(
            "debug: NaN logits injected at step %d, target %d of trajectory %d (%d forwards)",
            step,
            target,
            debug.nan_logits_sample,
            len(hits),
        )


def _last_stage_model(model):
    """The GPTModel of `model`'s chunk that computes logits on this rank, or None."""
    from megatron_agent.weights.export import unwrap

    for chunk in reversed(model.chunks):
        inner = unwrap(chunk)
        if getattr(inner, "post_process", False):
            return inner
    return None


def _matching_rows(input_ids_BS: torch.Tensor, seq_S: torch.Tensor) -> list[int]:
    """Rows of a right-padded micro-batch that hold exactly `seq_S` (then only padding id 0)."""
    num = seq_S.numel()
    if input_ids_BS.shape[1] < num:
        return []
    ids = input_ids_BS.cpu()
    same = (ids[:, :num] == seq_S).all(dim=1) & (ids[:, num:] == 0).all(dim=1)
    return same.nonzero().flatten().tolist()


def forced_turn_hook(debug, tokenizer):
    """A turn hook forcing `debug.forced_first_turn` as turn 0 of every trajectory, or None."""
    if not debug.forced_first_turn:
        return None
    from megatron_agent.rollout.chat import ChatFormat
    from megatron_agent.rollout.scripted import FORCED_KEY

    ids = ChatFormat(tokenizer).encode(debug.forced_first_turn)

    def hook(trajectory, turn: int):
        return {FORCED_KEY: ids} if turn == 0 else None

    return hook


def engine_logits_processors(debug) -> list:
    """The vLLM logits processors `forced_turn_hook` needs (none when it is off)."""
    if not debug.forced_first_turn:
        return []
    from megatron_agent.rollout.scripted import ForcedTokensLogitsProcessor

    return [ForcedTokensLogitsProcessor]


KILL_AFTER_ENGINE_STEPS = 3
"""Engine steps of the doomed rollout that run before `kill_engine_mid_rollout` kills the process."""


@contextlib.contextmanager
def kill_engine_mid_rollout(debug, engine, run_dir, rank: int, greedy: bool = False):
    """Within one `generate` call: SIGKILL this engine process after a few engine steps, when due.

    Due when `debug.kill_engine_at_step` is the current RL step (the rollout of RL step N runs on
    weight version N: the first sync makes version 1, each step's sync adds one), on engine 0,
    not for greedy (validation) rollouts, and only once per run folder: the marker file
    `<run_dir>/debug/engine_killed_at_step_N` is written just before the kill, so the replacement
    engine (and a resumed run) carries on. `engine` is the `VLLMEngine` whose `step` the agent
    loop's pump calls.
    """
    step = debug.kill_engine_at_step
    marker = Path(run_dir) / "debug" / f"engine_killed_at_step_{step}"
    if not step or greedy or rank != 0 or engine.weight_version != step or marker.exists():
        yield
        return
    real_step, num_steps = engine.step, [0]

    def doomed_step():
        num_steps[0] += 1
        if num_steps[0] > KILL_AFTER_ENGINE_STEPS:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"pid {os.getpid()}\n")
            print(
                f"debug.kill_engine_at_step={step}: engine {rank} (pid {os.getpid()}) kills itself "
                f"after {KILL_AFTER_ENGINE_STEPS} engine steps of the rollout",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step()

    engine.step = doomed_step
    try:
        yield
    finally:
        del engine.step  # the class's method again
