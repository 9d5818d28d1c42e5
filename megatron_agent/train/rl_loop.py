"""The RL loop: one step as stages, each returning its product, top to bottom.

    rollouts      prompts -> agent-loop rollouts (rollout.n per prompt; dynamic sampling
                  refills tied groups)                                      `collect_rollouts`
    scored batch  the training batch with its rewards (overlong penalty)    `scored_batch`
    log-probs     old (actor) and reference log-probs, forward only         `Trainer.logprobs`
    values        the critic's values, forward only (gae)                   `Trainer.submit_values`
    rewards       token rewards, the KL in the reward                       `token_rewards`
    advantages    advantages; the rollout IS weights when configured        `advantages`,
                  (the loss uses them)                                      `importance_weights`
    critic        the critic's epochs towards the returns (gae)             `Trainer.submit_train_critic`
    update        PPO epochs over mini-batches (the guard before every optimizer step; none in
                  the first `trainer.critic_warmup` steps of a gae run)     `Trainer.train`
    metrics       the rollout-vs-trainer mismatch (always after the update), batch statistics
                  (train/step_stats.py)
    sync          the weights into the rollout engines (verified)           `Trainer.sync`

Where old log-probs come from is decided once, in the plan (`RunPlan.old_logprobs_from_update`):
on-policy steps (one epoch, one mini-batch, no KL in the reward) take them from the update's own
forward, and the loss computes the rollout IS weights from them (their metrics come after the
update); otherwise the log-prob stage computes them and the IS weights come before the update.
Likewise the critic's values (`RunPlan.values_from_update`): on such steps with a colocated
critic, the critic's update runs before the advantages, its forward gives the values and it
computes its returns from them; otherwise a value pass gives them and the critic trains after.
Only `rl_step` attaches the stages' products to the batch. `Trainer` (trainer.py) owns the
workers; this file is the algorithm. In an async run (`trainer.mode=async`) the rollout stage
takes the batch admitted for this step (`RolloutPipeline.rollouts`; train/async_rollouts.py), the
step checks the staleness of its tokens, and the sync interrupts the engines' rollouts in flight
(they continue under the new weights).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_agent.rl import (
    apply_kl_in_reward,
    compute_advantages,
    rollout_is_weights,
    staleness_metrics,
)
from megatron_agent.rollout import rollout_metrics, write_rollout_dump
from megatron_agent.train.batch import (
    RLBatch,
    batch_from_trajectories,
    mini_batches,
    outcome_token_rewards,
    overlong_penalty,
)
from megatron_agent.train.step_stats import batch_stats, critic_stats, dump_fields, mismatch
from megatron_agent.train.trainer import Trainer

if TYPE_CHECKING:
    from megatron_agent.train.async_rollouts import RolloutPipeline


@contextmanager
def timer(metrics: dict, name: str):
    """Add the block's wall time to `metrics['timing_s/<name>']`."""
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


@dataclass
class Rollouts:
    """The rollout stage's product."""

    trajectories: list
    """Every kept trajectory, group by group."""
    group_ids: list[str]
    """The group of each trajectory."""
    group_tasks: dict
    """{group id: its task} (ReMax rolls each out again, greedily)."""


@dataclass
class Advantages:
    """The advantage stage's product: [B, T] tensors over the batch's targets."""

    adv_BT: torch.Tensor
    returns_BT: torch.Tensor


def rl_step(t: Trainer, step: int, pipeline: RolloutPipeline | None = None) -> dict[str, float]:
    """One RL step; returns its metrics (DESIGN.md names). `pipeline`: an async run's admitted
    rollouts (train/async_rollouts.py); None: generate this step's rollouts now."""
    algo, plan, m = t.cfg.algorithm, t.plan, {"step": step}
    with timer(m, "step"):
        with timer(m, "gen"):
            rollouts = collect_rollouts(t, m) if pipeline is None else pipeline.rollouts(step, m)
        m.update(rollout_metrics(rollouts.trajectories))
        if pipeline is None:
            m.update(t.tool_metrics())
        m["rollout/engine_restarts"] = float(t.engine_restarts)  # cumulative over the run
        batch = scored_batch(t, rollouts)

        value_pass = plan.uses_critic and not plan.values_from_update
        values = t.submit_values(batch) if value_pass else None  # beside the log-probs when apart
        tensors, timings = t.logprobs(batch)  # old_logp, entropy (unless from the update), ref_logp
        batch.tensors.update(tensors)
        m.update(timings)
        if values is not None:
            batch.tensors["values"], timings = values.result()
            m.update(timings)
        mask_BT = batch.padded("loss_mask")
        with timer(m, "adv"):
            rewards_BT = token_rewards(t, batch, mask_BT, m)
        critic_m = None
        if plan.values_from_update:  # the critic's update first: its forward gives the values
            batch.set_padded("token_rewards", rewards_BT)
            critic_m, tensors = t.submit_train_critic(batch, mini_batches(batch, 1), step).result()
            batch.tensors.update(tensors)
        with timer(m, "adv"):
            adv = advantages(t, batch, rollouts, rewards_BT, mask_BT)
            batch.set_padded("advantages", adv.adv_BT)
            weights_now = plan.rollout_is != "none" and not plan.old_logprobs_from_update
            if weights_now:  # the log-prob stage computed the old log-probs
                w_BT, is_m = importance_weights(batch, mask_BT, algo, plan.rollout_is, plan.rollout_is_mode)
                batch.set_padded("is_weights", w_BT)
                m.update(is_m)

        num_mini = min(plan.num_mini_batches, len(set(batch.group_ids)))
        critic_update = None
        if value_pass:  # the critic's update (beside the actor's when it has ranks of its own)
            batch.set_padded("returns", adv.returns_BT)
            critic_update = t.submit_train_critic(batch, mini_batches(batch, num_mini), step)
        if not (plan.uses_critic and step <= t.cfg.trainer.critic_warmup):
            with timer(m, "update_actor"):
                update_m, tensors = t.train(batch, mini_batches(batch, num_mini), step)
                batch.tensors.update(tensors)  # old_logp, entropy: from the update's forward when on-policy
                m.update(update_m)
        if critic_update is not None:
            critic_m = critic_update.result()[0]  # with timing_s/update_critic, the critic ranks' own
        if critic_m is not None:
            m.update(critic_m)
            m.update(critic_stats(batch, mask_BT, adv.returns_BT))
        with timer(m, "adv"):
            if plan.rollout_is != "none" and not weights_now:  # the loss computed them itself
                m.update(importance_weights(batch, mask_BT, algo, plan.rollout_is, plan.rollout_is_mode)[1])
            m.update(mismatch(batch, mask_BT, algo))
            m.update(batch_stats(batch, mask_BT, adv.adv_BT, adv.returns_BT))
        if pipeline is not None:
            m.update(
                staleness_metrics(
                    batch.padded("policy_version"),
                    batch.padded("old_logp"),
                    batch.padded("rollout_logp"),
                    mask_BT,
                    trainer_version=t.weight_version,
                    max_staleness=plan.max_staleness,
                )
            )
            pipeline.before_sync(step)  # the sync then interrupts the rollouts in flight
        with timer(m, "update_weights"):
            m.update(t.sync())
        if t.cfg.trainer.dump_rollouts:
            write_rollout_dump(
                t.run_dir, step, rollouts.trajectories, dump_fields(batch, rollouts.trajectories)
            )
    m["perf/throughput"] = sum(len(s) for s in batch.sequences) / m["timing_s/step"]
    return m


def scored_batch(t: Trainer, rollouts: Rollouts) -> RLBatch:
    """The training batch of the rollouts: groups, and rewards with DAPO's overlong penalty."""
    cfg, algo, trajectories = t.cfg, t.cfg.algorithm, rollouts.trajectories
    limits = [cfg.rollout.max_total_tokens - len(tr.prompt_ids) for tr in trajectories]
    penalty = overlong_penalty(
        [len(tr.response_ids) for tr in trajectories],
        min(limits),
        algo.overlong_buffer_len,
        algo.overlong_penalty_factor,
    )
    pad_id = t.tokenizer.pad_token_id or 0
    return batch_from_trajectories(trajectories, pad_id, group_ids=rollouts.group_ids, reward_offsets=penalty)


def token_rewards(t: Trainer, batch: RLBatch, mask_BT: torch.Tensor, m: dict) -> torch.Tensor:
    """Token rewards [B, T]: the outcome reward, minus the KL in the reward when configured (whose
    controller moves here; its metrics go to `m`)."""
    algo = t.cfg.algorithm
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
        t.kl_ctrl.update(m["critic/kl_reward"], len(batch))
    return rewards_BT


def advantages(
    t: Trainer, batch: RLBatch, rollouts: Rollouts, rewards_BT: torch.Tensor, mask_BT: torch.Tensor
) -> Advantages:
    """The advantages and returns of `algorithm.adv_estimator` from the token rewards."""
    algo = t.cfg.algorithm
    remax, gae = algo.adv_estimator == "remax", algo.adv_estimator == "gae"
    adv_BT, returns_BT = compute_advantages(
        algo.adv_estimator,
        rewards_BT,
        mask_BT,
        group_ids=batch.group_ids,
        gamma=algo.gamma,
        norm_by_std=algo.norm_adv_by_std,
        baseline_rewards_B=greedy_baseline(t, rollouts.group_ids, rollouts.group_tasks) if remax else None,
        values_BT=batch.padded("values") if gae else None,
        lam=algo.lam,
        lam_critic=algo.lam_critic,
    )
    return Advantages(adv_BT, returns_BT)


def collect_rollouts(t: Trainer, m: dict) -> Rollouts:
    """`data.train_batch_size` groups of `rollout.n` trajectories; with dynamic sampling, groups
    whose rewards all tie are dropped and more prompts are drawn, up to `max_num_gen_batches`.

    Adds `rollout/gen_batches` and `rollout/dropped_groups` to `m`."""
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
    return Rollouts(kept, group_ids, tasks)


def greedy_baseline(t: Trainer, group_ids: list[str], tasks: dict) -> torch.Tensor:
    """ReMax's baseline [B]: the reward of one greedy rollout of each sequence's task."""
    order = list(tasks)
    greedy = t.rollout([tasks[g] for g in order], 1, greedy=True)
    reward_of = {g: float(tr.reward or 0.0) for g, tr in zip(order, greedy)}
    return torch.tensor([reward_of[g] for g in group_ids], dtype=torch.float32)


def importance_weights(
    batch: RLBatch, mask_BT, algo, level: str, mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """The rollout-vs-trainer IS weights [B, T] at `level` ('token' or 'sequence':
    `RunPlan.rollout_is`; engine vs old log-probs, capped or masked as `RunPlan.rollout_is_mode`
    says) and their metrics. With an off-policy loss these are the behaviour weights
    pi_prox / pi_behaviour (the old log-probs are the proximal ones)."""
    w_BT, is_m = rollout_is_weights(
        batch.padded("rollout_logp"),
        batch.padded("old_logp"),
        mask_BT,
        level=level,
        cap=algo.rollout_is_cap,
        mode=mode,
    )
    return w_BT, {f"mismatch/{k}": float(v) for k, v in is_m.items()}
