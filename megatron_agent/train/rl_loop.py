"""The RL loop: one step, top to bottom.

    prompts -> agent-loop rollouts (rollout.n per prompt; dynamic sampling refills tied groups)
    -> old log-probs (actor) and reference log-probs -> rewards (overlong penalty, KL in the
    reward) and advantages -> rollout-vs-trainer mismatch and truncated IS weights
    -> PPO epochs over mini-batches (the guard before every optimizer step)
    -> weight sync into the rollout engines (verified) -> metrics and rollout dumps.

On-policy steps (one epoch, one mini-batch, no KL in the reward, no IS weights) skip the old
log-prob pass: the update's own forward provides them (`old_logprobs_from_update`), and the
mismatch metrics are computed after the update. The reference pass runs only when a KL needs it.

`Trainer` (trainer.py) owns the workers; this file is the algorithm.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from megatron_agent.rl import apply_kl_in_reward, compute_advantages, mismatch_metrics, rollout_is_weights
from megatron_agent.rollout import rollout_metrics, write_rollout_dump
from megatron_agent.train.batch import (
    RLBatch,
    batch_from_trajectories,
    mini_batches,
    outcome_token_rewards,
    overlong_penalty,
)
from megatron_agent.train.trainer import Trainer


@contextmanager
def timer(metrics: dict, name: str):
    """Add the block's wall time to `metrics['timing_s/<name>']`."""
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def rl_step(t: Trainer, step: int) -> dict[str, float]:
    """One RL step; returns its metrics (DESIGN.md names)."""
    cfg, algo, m = t.cfg, t.cfg.algorithm, {"step": step}
    with timer(m, "step"):
        with timer(m, "gen"):
            trajectories, group_ids, group_tasks = collect_rollouts(t, m)
        m.update(rollout_metrics(trajectories))
        m.update(t.tool_metrics())
        m["rollout/engine_restarts"] = float(t.engine_restarts)  # cumulative over the run
        batch = batch_from_trajectories(trajectories, pad_id=t.tokenizer.pad_token_id or 0)
        batch.group_ids = group_ids
        limits = [cfg.rollout.max_total_tokens - len(tr.prompt_ids) for tr in trajectories]
        penalty = overlong_penalty(
            [len(tr.response_ids) for tr in trajectories],
            min(limits),
            algo.overlong_buffer_len,
            algo.overlong_penalty_factor,
        )
        batch.rewards = batch.rewards + penalty

        m.update(t.logprobs(batch))  # old_logp and entropy (unless the update gives them), ref_logp
        with timer(m, "adv"):
            mask_BT = batch.padded("loss_mask")
            rewards_BT = outcome_token_rewards(batch)
            if algo.kl_reward_coef:
                rewards_BT, kl_m = apply_kl_in_reward(
                    rewards_BT,
                    batch.padded("old_logp"),
                    batch.padded("ref_logp"),
                    mask_BT,
                    t.kl_ctrl.value,  # algorithm.kl_reward_coef, moved by an adaptive kl_ctrl
                    estimator=algo.kl_reward_estimator,
                )
                m["critic/kl_reward"], m["critic/kl_coef"] = float(kl_m["kl_reward"]), t.kl_ctrl.value
                t.kl_ctrl.update(m["critic/kl_reward"], len(trajectories))
            remax = algo.adv_estimator == "remax"
            adv_BT, returns_BT = compute_advantages(
                algo.adv_estimator,
                rewards_BT,
                mask_BT,
                group_ids=batch.group_ids,
                gamma=algo.gamma,
                norm_by_std=algo.norm_adv_by_std,
                baseline_rewards_B=greedy_baseline(t, group_ids, group_tasks) if remax else None,
            )
            batch.set_padded("advantages", adv_BT)
            if not t.old_from_update:
                m.update(mismatch_and_correction(batch, mask_BT, algo))

        num_mini = t.plan.num_mini_batches
        with timer(m, "update_actor"):
            m.update(t.train(batch, mini_batches(batch, min(num_mini, len(set(batch.group_ids)))), step))
        with timer(m, "adv"):
            if t.old_from_update:  # old_logp and entropy came back from the update's forward
                m.update(mismatch_and_correction(batch, mask_BT, algo))
            m.update(batch_stats(batch, mask_BT, adv_BT, returns_BT))
        with timer(m, "update_weights"):
            m.update(t.sync())
        if cfg.trainer.dump_rollouts:
            write_rollout_dump(t.run_dir, step, trajectories, dump_fields(batch, trajectories))
    m["perf/throughput"] = sum(len(s) for s in batch.sequences) / m["timing_s/step"]
    return m


def collect_rollouts(t: Trainer, m: dict) -> tuple[list, list[str], dict]:
    """`data.train_batch_size` groups of `rollout.n` trajectories; with dynamic sampling, groups
    whose rewards all tie are dropped and more prompts are drawn, up to `max_num_gen_batches`.

    Returns (trajectories, group id of each, {group id: task})."""
    cfg = t.cfg
    want, kept, group_ids, rounds, dropped, tasks = cfg.data.train_batch_size, [], [], 0, 0, {}
    while len(group_ids) // cfg.rollout.n < want and rounds < max(1, cfg.algorithm.max_num_gen_batches):
        indices = t.sampler.next_batch(want - len(group_ids) // cfg.rollout.n)
        drawn = [t.train_tasks[i] for i in indices]
        trajectories = t.rollout(drawn, cfg.rollout.n)
        for k in range(len(indices)):
            group = trajectories[k * cfg.rollout.n : (k + 1) * cfg.rollout.n]
            tied = len({g.reward for g in group}) == 1
            if cfg.algorithm.dynamic_sampling and tied:
                dropped += 1
                continue
            kept.extend(group)
            group_id = f"{rounds}:{k}:{group[0].task_uid}"
            group_ids.extend([group_id] * len(group))
            tasks[group_id] = drawn[k]
        rounds += 1
        if not cfg.algorithm.dynamic_sampling:
            break
    m["rollout/gen_batches"] = float(rounds)
    m["rollout/dropped_groups"] = float(dropped)
    if not kept:
        raise RuntimeError(
            f"dynamic sampling kept no group in {rounds} generation rounds (every group's rewards tied); "
            "raise algorithm.max_num_gen_batches or rollout.n, or turn algorithm.dynamic_sampling off"
        )
    return kept, group_ids, tasks


def greedy_baseline(t: Trainer, group_ids: list[str], tasks: dict) -> torch.Tensor:
    """ReMax's baseline [B]: the reward of one greedy rollout of each sequence's task."""
    order = list(tasks)
    greedy = t.rollout([tasks[g] for g in order], 1, greedy=True)
    reward_of = {g: float(tr.reward or 0.0) for g, tr in zip(order, greedy)}
    return torch.tensor([reward_of[g] for g in group_ids], dtype=torch.float32)


def mismatch_and_correction(batch: RLBatch, mask_BT, algo) -> dict[str, float]:
    """Rollout-vs-trainer mismatch metrics (engine vs old log-probs) and, when configured, the
    truncated IS weights (`is_weights`, set on the batch for the loss)."""
    rollout_BT, old_BT = batch.padded("rollout_logp"), batch.padded("old_logp")
    mm = mismatch_metrics(rollout_BT, old_BT, mask_BT, thresholds=algo.mismatch_thresholds)
    out = {f"mismatch/{k}": float(v) for k, v in mm.items()}
    if algo.rollout_is != "none":
        w_BT, is_m = rollout_is_weights(
            rollout_BT,
            old_BT,
            mask_BT,
            level=algo.rollout_is,
            cap=algo.rollout_is_cap,
            mode=algo.rollout_is_mode,
        )
        batch.set_padded("is_weights", w_BT)
        out.update({f"mismatch/{k}": float(v) for k, v in is_m.items()})
    return out


def batch_stats(batch: RLBatch, mask_BT, adv_BT, returns_BT) -> dict[str, float]:
    """critic/* and actor/entropy statistics over the loss tokens (critic/kl when a reference ran)."""
    mask = mask_BT.bool()
    num = mask.sum().clamp(min=1)
    adv = adv_BT[mask]
    entropy_BT = batch.padded("entropy")
    stats = {
        "critic/rewards/mean": float(batch.rewards.mean()),
        "critic/advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
        "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
        "critic/advantages/min": float(adv.min()) if adv.numel() else 0.0,
        "critic/returns/mean": float(returns_BT[mask].mean()) if adv.numel() else 0.0,
        "actor/entropy": float(torch.where(mask, entropy_BT, 0.0).sum() / num),
    }
    if "ref_logp" in batch.tensors:
        kl_BT = batch.padded("old_logp") - batch.padded("ref_logp")
        stats["critic/kl"] = float(torch.where(mask, kl_BT, 0.0).sum() / num)
    return stats


def dump_fields(batch: RLBatch, trajectories: list) -> list[dict]:
    """Per-trajectory old/ref log-probs and advantages over the response tokens (for the dump)."""
    rows = []
    for b, traj in enumerate(trajectories):
        start = len(traj.prompt_ids) - 1  # target index of the first response token
        rows.append(
            {
                k: batch.tensors[name][b][start:].tolist()
                for k, name in (
                    ("old_logprobs", "old_logp"),
                    ("ref_logprobs", "ref_logp"),
                    ("advantages", "advantages"),
                )
                if name in batch.tensors  # ref_logprobs stays null when no reference ran
            }
        )
    return rows


def validate(t: Trainer) -> dict[str, float]:
    """Greedy rollouts of the validation tasks: val/score/mean and val/accuracy."""
    start = time.perf_counter()
    trajectories = t.rollout(t.val_tasks, 1, greedy=True)
    rewards = [tr.reward or 0.0 for tr in trajectories]
    return {
        "val/score/mean": sum(rewards) / len(rewards),
        "val/accuracy": sum(is_correct(tr) for tr in trajectories) / len(trajectories),
        "val/tool_calls_per_sample": sum(len(tr.tool_calls) for tr in trajectories) / len(trajectories),
        "timing_s/testing": time.perf_counter() - start,
    }


def is_correct(trajectory) -> bool:
    """True when the task's correctness reward (numeric, exact match or F1) is full."""
    info = trajectory.reward_info or {}
    scores = [v for k, v in info.items() if k in ("numeric", "exact_match", "f1")]
    return bool(scores) and max(scores) >= 1.0 - 1e-9
