"""The run plan: what a run derives from its config, computed once after loading and frozen.

The driver builds it (`make_plan`) and ships it to every worker with the config, so that the
driver and the workers read the same derived decisions (whether a reference model runs, where
old log-probs come from, ...) instead of each deriving them again; nothing mutates the config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatron_agent.config.schema import Config


@dataclass(frozen=True)
class RunPlan:
    """Derived, read-only facts of one run."""

    run_dir: str
    """The run folder (`trainer.run_dir`)."""
    model_path: str
    """HF folder the models start from: `model.path`, or `<run_dir>/base_model` (made by the run)."""
    tiny_family: str
    """The tiny model the run makes at `model_path` when `model.path` is empty ('' otherwise)."""
    uses_reference: bool
    """A frozen reference model is built and its log-probs computed (a KL term or the KL guard)."""
    uses_critic: bool
    """A critic (value model) is built and trained: `algorithm.adv_estimator=gae`."""
    critic_init_from: str
    """The checkpoint whose critic the critic starts from (`critic.init_from`; '' : the actor's
    weights and a new head)."""
    critic_layout: tuple[int, int, int, int]
    """(tp, pp, vpp, dp) of a critic on ranks of its own (`critic.placement=separate`, zeros
    resolved to the actor's); () when the critic is colocated with the actor or absent."""
    qat_format: str
    """The weight format the actor's forward fake-quantizes to (`actor.qat`, FP8 scales of
    `rollout.fp8_scales`: a `quant.formats` name); '' without QAT."""
    rollout_is: str
    """The rollout IS weights the loss uses: 'none', 'token' or 'sequence' (`algorithm.rollout_is`,
    'auto' resolved: 'token' with an off-policy correction or an FP8 rollout, else 'none')."""
    rollout_is_mode: str
    """Weights above the cap: 'mask' (`algorithm.off_policy_loss=decoupled`), 'truncate' (`tis`),
    else `algorithm.rollout_is_mode`."""
    mode: str
    """'sync' or 'async' (`trainer.mode`)."""
    max_staleness: int
    """The staleness bound eta of an async run (`async.max_staleness`); 0 in sync mode."""
    share_cores: bool
    """An async run that is not deterministic with `async.share_cores`: on CPU, a rank runs on
    half its threads while an engine of its machine generates (`platform/core_sharing.py`)."""
    old_logprobs_from_update: bool
    """Old log-probs come from the update's own forward (else from a forward-only pass before it)."""
    values_from_update: bool
    """The critic's values come from its update's own forward (else from a value pass before it)."""
    num_mini_batches: int
    """Optimizer steps per PPO epoch of one RL step."""
    total_optimizer_steps: int
    """Optimizer steps of the whole RL run (the LR schedule's length)."""
    tools: tuple[str, ...]
    """Enabled tools: `tools.enabled`, plus `search` for synthetic multihop tasks."""
    search_index_dir: str
    """The `search` tool's index: `tools.search_index_dir`, or the synthetic multihop index."""
    synthetic_dirs: tuple[str, str]
    """Folders of the synthetic multihop (train, validation) corpora ('' when not used)."""
    checkpoint_root: str
    """Where checkpoints go: `checkpoint.save_dir` or `<run_dir>/checkpoints`."""

    def to_dict(self) -> dict:
        """Plain values (for Ray and JSON)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunPlan:
        """Rebuild from `to_dict` output."""
        return cls(
            **{
                **data,
                "tools": tuple(data["tools"]),
                "synthetic_dirs": tuple(data["synthetic_dirs"]),
                "critic_layout": tuple(data["critic_layout"]),
            }
        )


def uses_reference(cfg: Config) -> bool:
    """True when the step needs the frozen reference's log-probs (a KL term or the KL guard)."""
    a = cfg.algorithm
    return bool(a.kl_loss_coef or a.kl_reward_coef or (a.guard_enabled and a.guard_max_abs_kl is not None))


def critic_layout(cfg: Config) -> tuple[int, int, int, int] | tuple[()]:
    """(tp, pp, vpp, dp) of a separate critic (`critic.*`, 0: the actor's `parallel.*`; vpp: the
    actor's only at the actor's pipeline size); () when no critic runs on ranks of its own."""
    c, p = cfg.critic, cfg.parallel
    if cfg.algorithm.adv_estimator != "gae" or c.placement != "separate":
        return ()
    pp = c.pp or p.pp
    return (c.tp or p.tp, pp, c.vpp or (p.vpp if pp == p.pp else 1), c.dp or p.dp)


def qat_format_name(cfg: Config) -> str:
    """The `quant.formats` name of `actor.qat` ('' : off): fp8 takes `rollout.fp8_scales`."""
    qat = cfg.actor.qat
    if not qat:
        return ""
    return ("fp8" if cfg.rollout.fp8_scales == "tensor" else "fp8_block128") if qat == "fp8" else "nvfp4"


def num_mini_batches(cfg: Config) -> int:
    """Optimizer steps per PPO epoch of an RL step (prompts per step / prompts per mini-batch)."""
    return cfg.data.train_batch_size // (cfg.actor.ppo_mini_batch_size or cfg.data.train_batch_size)


def rollout_is(cfg: Config) -> str:
    """`algorithm.rollout_is` with 'auto' resolved: token-level IS for an off-policy correction
    or an FP8 rollout (its log-probs differ from the BF16 trainer's), none otherwise."""
    mode = cfg.algorithm.rollout_is
    if mode == "auto":
        return "token" if cfg.algorithm.off_policy_loss or cfg.rollout.quantization else "none"
    return mode


def rollout_is_mode(cfg: Config) -> str:
    """What happens to IS weights above the cap: the off-policy loss decides when one is set."""
    return {"decoupled": "mask", "tis": "truncate"}.get(
        cfg.algorithm.off_policy_loss, cfg.algorithm.rollout_is_mode
    )


def old_logprobs_from_update(cfg: Config) -> bool:
    """True when the old log-probs are taken from the update's own forward (`actor.old_logprobs`).

    Only for on-policy steps: one PPO epoch over one mini-batch, so the weights of that forward
    are the weights that are "old" (the proximal policy of an off-policy loss), and nothing needs
    the old log-probs before the update (no KL in the reward). The loss then uses the detached
    current log-probs as old ones: the ratio is exactly 1 and the gradient is the on-policy
    policy gradient. Rollout IS weights (pi_old / pi_engine) are then computed inside the loss
    from the same detached log-probs, micro-batch by micro-batch (sequences are never split).
    """
    a, algo = cfg.actor, cfg.algorithm
    return (
        a.old_logprobs == "auto"
        and a.ppo_epochs == 1
        and num_mini_batches(cfg) == 1
        and not algo.kl_reward_coef
        and not (algo.adv_estimator == "gae" and cfg.trainer.critic_warmup)  # steps without an update
    )


def values_from_update(cfg: Config) -> bool:
    """True when the critic's values before its update are taken from the update's own forward
    (`critic.values`).

    Only when that forward sees the weights the values are of: one critic epoch over one
    mini-batch, and the critic on the actor's ranks (a separate critic computes its value pass
    while the actor's log-probs are computed, and trains while the actor trains; taking the
    values from its update would make the actor wait for it). GAE runs within each sequence, so
    the update computes a micro-batch's returns from that micro-batch's values; the clip around
    the old values does not bind (old = current) and the loss is the plain squared error.
    """
    c = cfg.critic
    return (
        cfg.algorithm.adv_estimator == "gae"
        and c.values == "auto"
        and c.placement == "colocated"
        and c.ppo_epochs == 1
        and num_mini_batches(cfg) == 1
    )


def checkpoint_root(cfg: Config) -> Path:
    """Where checkpoints go: `checkpoint.save_dir`, or `<trainer.run_dir>/checkpoints`."""
    return Path(cfg.checkpoint.save_dir or Path(cfg.trainer.run_dir) / "checkpoints")


def make_plan(cfg: Config) -> RunPlan:
    """The plan of a validated config (no side effects: folders and models are made by the run)."""
    run_dir = Path(cfg.trainer.run_dir)
    d, t = cfg.data, cfg.tools
    multihop = d.synthetic == "multihop"
    synthetic_dirs = (
        str(run_dir / "synthetic") if multihop and not d.train_path else "",
        str(run_dir / "synthetic_val") if multihop and not d.val_path else "",
    )
    tools = tuple(t.enabled)
    index_dir = t.search_index_dir
    if any(synthetic_dirs):
        tools = tools if "search" in tools else (*tools, "search")
        index_dir = index_dir or str(Path(next(s for s in synthetic_dirs if s)) / "index")
    return RunPlan(
        run_dir=str(run_dir),
        model_path=cfg.model.path or str(run_dir / "base_model"),
        tiny_family="" if cfg.model.path else cfg.model.tiny_family,
        uses_reference=uses_reference(cfg),
        uses_critic=cfg.algorithm.adv_estimator == "gae",
        critic_init_from=cfg.critic.init_from if cfg.algorithm.adv_estimator == "gae" else "",
        critic_layout=critic_layout(cfg),
        qat_format=qat_format_name(cfg),
        rollout_is=rollout_is(cfg),
        rollout_is_mode=rollout_is_mode(cfg),
        mode=cfg.trainer.mode,
        max_staleness=cfg.async_.max_staleness if cfg.trainer.mode == "async" else 0,
        share_cores=cfg.trainer.mode == "async" and not cfg.trainer.deterministic and cfg.async_.share_cores,
        old_logprobs_from_update=old_logprobs_from_update(cfg),
        values_from_update=values_from_update(cfg),
        num_mini_batches=num_mini_batches(cfg),
        total_optimizer_steps=cfg.trainer.total_steps * cfg.actor.ppo_epochs * num_mini_batches(cfg),
        tools=tools,
        search_index_dir=index_dir,
        synthetic_dirs=synthetic_dirs,
        checkpoint_root=str(checkpoint_root(cfg)),
    )
