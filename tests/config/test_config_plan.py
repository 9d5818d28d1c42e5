"""What the run derives from its config: the plan, the model's build options, refusals at load."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_agent.config import ConfigError, RunPlan, load_config, make_plan
from megatron_agent.train.megatron_worker import build_options


def plan(*overrides: str) -> RunPlan:
    return make_plan(load_config(None, ["trainer.run_dir=/tmp/plan_run", *overrides]))


def test_defaults_are_on_policy_without_a_reference():
    p = plan()
    assert p.old_logprobs_from_update and not p.uses_reference
    assert p.num_mini_batches == 1 and p.total_optimizer_steps == 10
    assert p.model_path == "/tmp/plan_run/base_model" and p.tiny_family == "qwen2"
    assert p.tools == ("calculator",) and p.checkpoint_root == "/tmp/plan_run/checkpoints"


@pytest.mark.parametrize(
    "override, field, value",
    [
        ("algorithm.kl_loss_coef=0.1", "uses_reference", True),
        ("algorithm.guard_max_abs_kl=1.0", "uses_reference", True),
        ("actor.ppo_epochs=2", "old_logprobs_from_update", False),
        ("actor.old_logprobs=recompute", "old_logprobs_from_update", False),
        ("algorithm.kl_reward_coef=0.1", "old_logprobs_from_update", False),
        ("algorithm.rollout_is=token", "rollout_is", "token"),  # the update's forward weights its tokens
        ("actor.ppo_mini_batch_size=2", "num_mini_batches", 2),
        ("trainer.total_steps=3", "total_optimizer_steps", 3),
        ("checkpoint.save_dir=/elsewhere", "checkpoint_root", "/elsewhere"),
    ],
)
def test_a_setting_changes_the_plan(override, field, value):
    assert getattr(plan(override), field) == value


GAE = "algorithm.adv_estimator=gae"


@pytest.mark.parametrize(
    "overrides, from_update",
    [
        ((GAE,), True),  # a colocated critic, one epoch, one mini-batch
        ((), False),  # no critic
        ((GAE, "critic.values=pass"), False),
        ((GAE, "critic.ppo_epochs=2"), False),  # the second epoch's forward has moved on
        ((GAE, "data.train_batch_size=4", "actor.ppo_mini_batch_size=2"), False),
        ((GAE, "critic.placement=separate"), False),  # its value pass overlaps the actor's
        ((GAE, "actor.ppo_epochs=2"), True),  # the actor's epochs are the actor's
        ((GAE, "trainer.critic_warmup=1"), True),
    ],
)
def test_the_critic_takes_its_values_from_its_update_only_where_that_forward_is_at_the_old_weights(
    overrides, from_update
):
    assert plan(*overrides).values_from_update is from_update


def test_the_guard_off_needs_no_reference_for_its_kl_limit():
    assert not plan("algorithm.guard_max_abs_kl=1.0", "algorithm.guard_enabled=false").uses_reference


def test_multihop_tasks_enable_search_on_its_index_without_changing_the_config():
    cfg = load_config(None, ["trainer.run_dir=/tmp/plan_run", "data.synthetic=multihop"])
    before = dataclasses.asdict(cfg)
    p = make_plan(cfg)
    assert p.tools == ("calculator", "search")
    assert p.search_index_dir == "/tmp/plan_run/synthetic/index"
    assert dataclasses.asdict(cfg) == before  # the config is never mutated
    assert RunPlan.from_dict(p.to_dict()) == p  # what the workers get


def test_model_settings_reach_the_build_options():
    cfg = load_config(None, ["model.recompute=full", "model.dtype=bf16", "parallel.tp=2"], validate=False)
    opts = build_options(cfg)
    assert (opts.recompute, opts.dtype, opts.tp) == ("full", "bf16", 2)
    cfg = load_config(None, ["model.fp8=delayed"], validate=False)  # validate=False: not on this CPU
    assert build_options(cfg).fp8 == "delayed"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.fp8=delayed", "model.fp8='delayed' needs Transformer Engine on a CUDA GPU"),
        ("model.transformer_impl=te", "model.transformer_impl=te needs Transformer Engine"),
        ("rollout.quantization=fp8", "rollout.quantization='fp8' needs a CUDA GPU"),
        ("model.fp8=e4m3", "config key 'model.fp8'='e4m3': choose one of '', delayed, tensorwise"),
        ("actor.lr_decay=step", "config key 'actor.lr_decay'='step': choose one of constant, linear, cosine"),
        ("algorithm.adv_estimator=vtrace", "choose one of grpo, rloo"),
        ("model.logprob_chunk_tokens=0", "model.logprob_chunk_tokens=0 must be >= 1"),
    ],
)
def test_settings_that_cannot_work_here_are_refused_at_load(override, message):
    import torch

    if "needs" in message and torch.cuda.is_available():
        pytest.skip("a GPU is present: these settings can work")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, override.split())


ASYNC = ["trainer.mode=async", "algorithm.off_policy_loss=decoupled"]


@pytest.mark.parametrize(
    "overrides, shares",
    [
        (ASYNC, True),
        ([*ASYNC, "async.share_cores=false"], False),
        ([*ASYNC, "trainer.deterministic=true"], False),  # the threads would follow the engine's timing
        ([], False),  # sync: engines and ranks take turns
    ],
)
def test_ranks_share_cores_with_engines_only_in_async_runs_that_are_not_deterministic(overrides, shares):
    assert plan(*overrides).share_cores is shares


def test_a_critic_runs_in_async_mode_with_its_values_from_its_update():
    p = plan(*ASYNC, "algorithm.adv_estimator=gae")
    assert p.mode == "async" and p.uses_critic and p.values_from_update


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.mode=async"],
            "trainer.mode=async needs an off-policy correction: set algorithm.off_policy_loss",
        ),
        ([*ASYNC, "async.max_staleness=-1"], "async.max_staleness=-1 must be >= 0"),
        ([*ASYNC, "algorithm.rollout_is=none"], "algorithm.rollout_is=none turns those weights off"),
        ([*ASYNC, "algorithm.dynamic_sampling=true"], "not supported with trainer.mode=async yet"),
        ([*ASYNC, "algorithm.adv_estimator=remax"], "remax is not supported with trainer.mode=async"),
        (
            [*ASYNC, "algorithm.adv_estimator=gae", "trainer.critic_warmup=1"],
            "trainer.mode=async with trainer.critic_warmup=1: a warm-up step does not update the actor",
        ),
        (
            [*ASYNC, "async.interrupt_after_engine_steps=0"],
            "async.interrupt_after_engine_steps=0 must be >= 1",
        ),
        (
            ["async.max_stalenes=2"],
            "unknown config key 'async.max_stalenes'; did you mean 'async.max_staleness'",
        ),
    ],
)
def test_async_settings_that_cannot_work_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_the_off_policy_loss_sets_the_proximal_pass_and_the_weights():
    p = plan(*ASYNC, "async.max_staleness=2")
    assert (p.mode, p.max_staleness, p.rollout_is, p.rollout_is_mode) == ("async", 2, "token", "mask")
    # One epoch over one mini-batch: the proximal log-probs are the update's own forward; with
    # two mini-batches the second one's proximal policy is not the updated one: a pass before.
    assert p.old_logprobs_from_update
    assert not plan(*ASYNC, "data.train_batch_size=4", "actor.ppo_mini_batch_size=2").old_logprobs_from_update
    assert (
        plan("algorithm.off_policy_loss=tis", "algorithm.rollout_is=sequence").rollout_is_mode == "truncate"
    )
    assert plan("algorithm.off_policy_loss=tis", "algorithm.rollout_is=sequence").rollout_is == "sequence"
    assert plan("async.max_staleness=3").max_staleness == 0  # sync mode: no staleness
    assert plan().rollout_is_mode == "truncate" and plan().mode == "sync"


def test_the_async_section_round_trips_under_its_yaml_key(tmp_path):
    from megatron_agent.config import config_from_dict, config_to_dict

    path = tmp_path / "c.yaml"
    path.write_text("trainer: {mode: async}\nalgorithm: {off_policy_loss: tis}\nasync: {max_staleness: 2}\n")
    cfg = load_config(path)
    data = config_to_dict(cfg)
    assert data["async"]["max_staleness"] == 2 and "async_" not in data
    assert config_from_dict(data).async_.max_staleness == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.adv_estimator=gae", "critic.tp=2"], "critic.tp=2 set with critic.placement=colocated"),
        (["critic.placement=separate"], "critic.placement=separate but algorithm.adv_estimator=grpo"),
        (
            ["algorithm.adv_estimator=gae", "critic.placement=separate", "critic.vpp=2"],
            "critic.vpp=2 needs a critic pipeline",
        ),
        (["critic.placement=apart"], "choose one of colocated, separate"),
    ],
)
def test_a_critic_layout_without_ranks_of_its_own_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_separate_critic_takes_the_actors_layout_where_its_own_keys_are_zero():
    gae = ["algorithm.adv_estimator=gae", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"]
    assert make_plan(load_config(None, gae)).critic_layout == ()  # colocated: the actor's ranks
    plan = make_plan(load_config(None, [*gae, "critic.placement=separate", "critic.dp=3"]))
    assert plan.critic_layout == (2, 2, 2, 3)
    cfg = load_config(None, [*gae, "critic.placement=separate", "critic.pp=4"])
    plan = make_plan(cfg)
    assert plan.critic_layout == (2, 4, 1, 1)  # another pipeline: no interleaving unless asked
    assert RunPlan.from_dict(plan.to_dict()) == plan
    opts = build_options(cfg, plan.critic_layout)  # what the critic's ranks build
    assert (opts.tp, opts.pp, opts.vpp) == (2, 4, 1)
