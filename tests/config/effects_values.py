"""The config-effects test's base config, chosen values and contexts (tests/config/test_config_effects.py)."""

from __future__ import annotations

import typing

from megatron_agent.config import load_config
from tests.config.test_config_fields import leaf_fields

# Fields that only take effect on a GPU (this test checks that each changes nothing on this CPU).
GPU_ONLY = {
    "model.fp8": "Transformer Engine FP8 recipes; every value but '' is refused at load without a GPU",
    "model.ref_offload": "moves the reference's weights off the GPU; MegatronModel.offload is a no-op on CPU",
    "rollout.colocate": "only decides whether engines get GPUs of their own (Trainer.start)",
    "sync.probe_tol_fp8": "the probe tolerance of real FP8 engines (rollout.quantization=fp8, GPU only)",
    "sync.probe_tol_nvfp4": "the probe tolerance of real NVFP4 engines (nvfp4_w4a16, GPU only)",
    "sync.transport": "a Ray engine on a CPU host is reached by shm only (direct: in-process engines)",
}

# The base of every config here: a short, cheap run. Deterministic mode makes the stand-in engine's
# replies depend on per-request seeds only (not on the order tools finish in), so effects repeat.
BASE = [
    "trainer.total_steps=1",
    "trainer.deterministic=true",
    "data.train_batch_size=2",
    "data.num_synthetic_tasks=4",
    "data.num_synthetic_val_tasks=2",
    "rollout.n=2",
    "sft.num_synthetic=8",
    "sft.batch_size=4",
    "logging.plot=false",
]

# Chosen values; `mutation`'s rule gives the rest. Files ({...}: made once per module), values the
# rule cannot make (strings, lists), and numbers that must stay meaningful or act on the fixed inputs.
VALUES: dict[str, object] = {
    "model.path": "{model}",
    "model.transformer_impl": "local",
    "rollout.max_trajectory_seconds": 30.0,
    "rollout.max_engine_restarts": 0,
    "rollout.top_p": 0.9,
    "rollout.top_k": 5,
    "rollout.max_new_tokens": 4,
    "rollout.max_turns": 1,
    "rollout.max_total_tokens": 400,
    "rollout.gpu_memory_utilization": 0.8,
    "rollout.fp8_scales": "block128",
    "rollout.quantization": "nvfp4_qdq",  # fp8 and nvfp4_w4a16 are refused at load without a GPU
    "algorithm.clip_ratio_low": 0.1,
    "algorithm.clip_ratio_high": 0.1,
    "algorithm.clip_ratio_c": 1.5,
    "algorithm.kl_loss_coef": 0.1,
    "algorithm.kl_reward_coef": 0.1,
    "algorithm.entropy_coef": 0.01,
    "algorithm.log_ratio_clamp": 0.5,
    "algorithm.gamma": 0.5,
    "algorithm.lam": 0.9,
    "algorithm.lam_critic": 0.8,
    "critic.min_lr": 1e-6,
    "critic.init_from": "{critic_init_from}",
    "critic.lr_warmup_steps": 2,
    **{f"critic.{name}": 2 for name in ("tp", "pp", "vpp", "dp")},  # 1 is the actor's (0's meaning)
    "critic.weight_decay": 0.01,
    "trainer.critic_warmup": 1,
    "algorithm.loss_agg_horizon": 100,
    "algorithm.kl_reward_estimator": "k3",
    "algorithm.kl_target": 0.5,
    "algorithm.kl_horizon": 100,
    "algorithm.rollout_is": "token",
    "algorithm.rollout_is_cap": 1.01,
    "algorithm.mismatch_thresholds": [0.05],
    "algorithm.max_num_gen_batches": 1,
    "algorithm.overlong_buffer_len": 400,
    "algorithm.overlong_penalty_factor": 0.5,
    "algorithm.guard_max_abs_log_ratio": 0.5,
    "algorithm.guard_max_ratio": 1.5,
    "algorithm.guard_max_rollout_abs_log_ratio": 0.5,
    "algorithm.guard_max_abs_kl": 0.5,
    "algorithm.guard_max_grad_norm": 0.5,
    "algorithm.guard_top_k": 2,
    "algorithm.guard_max_consecutive_skips": 1,
    "actor.ppo_mini_batch_size": 1,
    "actor.micro_batch_tokens": 16,
    "actor.lr_warmup_steps": 2,
    "actor.min_lr": 1e-6,
    "actor.weight_decay": 0.01,
    "data.train_path": "{train_tasks}",
    "data.val_path": "{val_tasks}",
    "data.val_batch_size": 1,
    "data.max_prompt_length": 364,  # the base's synthetic prompts have 360 to 368 tokens
    "data.arithmetic_max_depth": 1,
    "tools.enabled": ["calculator", "python"],
    "tools.max_tool_response_tokens": 8,
    "tools.search_index_dir": "{search_index}",
    "tools.search_top_k": 1,
    "tools.python.sandbox": "off",
    "tools.python.memory_mb": 256,
    "tools.python.tmp_mb": 32,
    "tools.max_concurrent": 3,
    "sft.steps": 2,
    "sft.data_path": "{sft_rows}",
    "sft.num_synthetic": 6,
    "sft.tool_use_rate": 0.9,
    "sft.batch_size": 2,
    "sft.lr": 1e-3,
    "sft.warmup_steps": 1,
    "sft.min_lr_ratio": 0.5,
    "sync.probe_tol_fp32": 1e-3,
    "sync.probe_tol_bf16": 0.2,
    "sync.probe_tol_fp8": 0.25,
    "sync.transport": "shm",
    "trainer.run_dir": "runs/other",
    "trainer.test_freq": 1,
    "trainer.resume": "{checkpoints}/step_000001",
    "trainer.init_from": "{init_from}",
    "ray.address": "auto",
    "ray.num_cpus": 1,
    "checkpoint.save_dir": "ckpts",
    "checkpoint.keep_last": 1,
    "debug.nan_logits_step": 1,
    "debug.nan_logits_sample": 1,
    "debug.nan_logits_token": 1,
    "debug.forced_first_turn": "<answer>4</answer>",
    "debug.kill_engine_at_step": 1,
    "debug.hold_at": "update:1",
    "logging.wandb_project": "effects",
}

# Settings a field acts under, applied on both sides of its comparison.
CONTEXT: dict[str, list[str]] = {
    "parallel.vpp": ["parallel.pp=2"],
    "trainer.mode": ["algorithm.off_policy_loss=decoupled"],  # async needs a correction
    "async_.max_staleness": ["trainer.mode=async", "algorithm.off_policy_loss=decoupled"],
    "async_.keep_kv": ["trainer.mode=async", "algorithm.off_policy_loss=decoupled"],
    "async_.share_cores": [  # not in deterministic mode (the threads follow the engine's timing)
        "trainer.mode=async",
        "algorithm.off_policy_loss=decoupled",
        "trainer.deterministic=false",
    ],
    "async_.interrupt_after_engine_steps": [  # batch 2 pauses for the sync after update 1
        "trainer.mode=async",
        "algorithm.off_policy_loss=decoupled",
        "trainer.deterministic=true",
        "trainer.total_steps=2",
    ],
    "rollout.max_engine_restarts": ["debug.kill_engine_at_step=1"],
    "algorithm.kl_loss_estimator": ["algorithm.kl_loss_coef=0.1"],
    "algorithm.kl_reward_estimator": ["algorithm.kl_reward_coef=0.1"],
    "algorithm.kl_ctrl": ["algorithm.kl_reward_coef=0.1"],
    "algorithm.kl_target": ["algorithm.kl_ctrl=adaptive", "algorithm.kl_reward_coef=0.1"],
    "algorithm.kl_horizon": ["algorithm.kl_ctrl=adaptive", "algorithm.kl_reward_coef=0.1"],
    "algorithm.gamma": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "algorithm.lam": ["algorithm.adv_estimator=gae"],
    "algorithm.lam_critic": ["algorithm.adv_estimator=gae"],
    "trainer.critic_warmup": ["algorithm.adv_estimator=gae"],
    "critic.init_from": ["algorithm.adv_estimator=gae"],
    "critic.placement": ["algorithm.adv_estimator=gae"],
    "critic.values": ["algorithm.adv_estimator=gae"],
    **{
        f"critic.{name}": [
            "algorithm.adv_estimator=gae",
            "critic.placement=separate",
            *(["critic.pp=2"] if name == "vpp" else []),
        ]
        for name in ("tp", "pp", "vpp", "dp")
    },
    **{
        f"critic.{name}": [
            "algorithm.adv_estimator=gae",
            *(["critic.lr_decay=linear"] if name == "min_lr" else []),
        ]
        for name in ("lr", "lr_warmup_steps", "lr_decay", "min_lr", "weight_decay", "grad_clip", "ppo_epochs")
        + ("cliprange_value",)
    },
    "algorithm.loss_agg_horizon": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
    "algorithm.rollout_is_cap": ["algorithm.rollout_is=token"],
    "algorithm.rollout_is_mode": ["algorithm.rollout_is=token", "algorithm.rollout_is_cap=1.01"],
    "algorithm.max_num_gen_batches": ["algorithm.dynamic_sampling=true"],
    "algorithm.overlong_penalty_factor": ["algorithm.overlong_buffer_len=400"],
    "algorithm.guard_top_k": ["algorithm.guard_max_abs_log_ratio=0.5"],
    "algorithm.guard_max_consecutive_skips": ["algorithm.guard_max_abs_log_ratio=0.5"],
    "actor.min_lr": ["actor.lr_decay=linear"],
    "tools.search_top_k": ["tools.enabled=[calculator,search]", "tools.search_index_dir={search_index}"],
    "tools.python.sandbox": ["tools.enabled=[calculator,python]"],
    "tools.python.memory_mb": ["tools.enabled=[calculator,python]"],
    "tools.python.max_processes": ["tools.enabled=[calculator,python]"],
    "tools.python.tmp_mb": ["tools.enabled=[calculator,python]"],
    "tools.max_concurrent": ["tools.enabled=[calculator,python]"],
    "sync.probe_tol_bf16": ["model.dtype=bf16"],
    "actor.qat": ["rollout.quantization=fp8_qdq"],
    "trainer.resume": ["trainer.total_steps=2"],  # resumes after step 1, then trains step 2
    "checkpoint.keep_last": ["trainer.total_steps=2", "checkpoint.save_freq=1"],
    "checkpoint.on_save_error": ["checkpoint.save_dir={blocked}/ckpts", "checkpoint.save_freq=1"],
    "debug.nan_logits_sample": ["debug.nan_logits_step=1"],
    "debug.nan_logits_token": ["debug.nan_logits_step=1"],
    **{
        f"sft.{name}": ["sft.steps=2", *(["sft.warmup_steps=0"] if name == "min_lr_ratio" else [])]
        for name in ("data_path", "num_synthetic", "tool_use_rate", "batch_size", "lr", "warmup_steps")
        + ("min_lr_ratio", "seed")
    },
}

FIELDS = {".".join((*path, name)): cls for path, name, cls in leaf_fields()}


# --------------------------------------------------------------------------------- values
def _field_type(dotted: str):
    return typing.get_type_hints(FIELDS[dotted])[dotted.rsplit(".", 1)[1]]


def _current(dotted: str, overrides: list[str]):
    """The field's value in the config of `overrides` (validation aside)."""
    obj = load_config(None, overrides, validate=False)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def mutation(dotted: str, base: list[str]):
    """A value of `dotted` other than its value in `base`: VALUES, or flip / next choice / another number."""
    if dotted in VALUES:
        return VALUES[dotted]
    typ, now = _field_type(dotted), _current(dotted, base)
    if typing.get_origin(typ) is typing.Literal:
        choices = typing.get_args(typ)
        return choices[(choices.index(now) + 1) % len(choices)]
    if typ is bool:
        return not now
    if typ is int:
        return now + 1 if now >= 0 else 1
    if typ is float:
        return now * 2 if now else 0.5
    raise AssertionError(f"{dotted}: no rule for a {typ} value; add one to VALUES")


def _text(value, files: dict[str, str]) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value).format(**files) if isinstance(value, str) else str(value)


def overrides_of(dotted: str, files: dict[str, str]) -> tuple[list[str], list[str]]:
    """(base, mutated) overrides of the comparison of `dotted`."""
    base = BASE + [o.format(**files) for o in CONTEXT.get(dotted, [])]
    value = mutation(dotted, base)
    return base, [*base, f"{dotted}={_text(value, files)}"]
