"""The one validation pass of a loaded config: every check that needs no worker.

Types, choices and ranges of single fields are checked while the config is loaded (`load.py`,
`constraints.py`); here are the checks that involve several fields, the file system or the
machine, all reported at once. Each error names the key and the fix. The layout check against the model's heads and layers needs its `config.json`, so the
trainer runs it once the model folder exists (`train.trainer.check_layout`).
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path

from megatron_agent.config.schema import BUILTIN_TOOLS, KILL_PHASES, Config, ConfigError


def validate_config(cfg: Config) -> None:
    """Raise one `ConfigError` listing every setting that cannot work (the single-field ranges
    were checked while loading, so each check here may assume them)."""
    problems: list[str] = []
    checks = (_check_sizes, _check_paths, _check_parallel, _check_async, _check_quantization, _check_tools)
    for check in (*checks, _check_debug):
        problems += check(cfg)
    if problems:
        raise ConfigError.of(problems)
    _check_machine(cfg)


def _check_sizes(cfg: Config) -> list[str]:
    a, d, r, problems = cfg.actor, cfg.data, cfg.rollout, []
    mini = a.ppo_mini_batch_size or d.train_batch_size
    if d.train_batch_size % mini:
        problems.append(
            f"data.train_batch_size={d.train_batch_size} is not divisible by actor.ppo_mini_batch_size={mini}: "
            f"choose a mini-batch size that divides it (e.g. {math.gcd(d.train_batch_size, mini)})"
        )
    if r.num_engines > d.train_batch_size:
        problems.append(
            f"rollout.num_engines={r.num_engines} exceeds data.train_batch_size={d.train_batch_size}: "
            "fewer engines than prompts per step"
        )
    if r.max_new_tokens >= r.max_total_tokens:
        problems.append(
            f"rollout.max_new_tokens={r.max_new_tokens} must be < rollout.max_total_tokens={r.max_total_tokens} "
            "(the prompt and the response share the total)"
        )
    if a.min_lr > a.lr:
        problems.append(f"actor.min_lr={a.min_lr:g} exceeds actor.lr={a.lr:g}: the decay ends below the peak")
    c = cfg.critic
    if cfg.algorithm.adv_estimator == "gae" and c.min_lr > c.lr:
        problems.append(
            f"critic.min_lr={c.min_lr:g} exceeds critic.lr={c.lr:g}: the decay ends below the peak"
        )
    return problems


def _check_paths(cfg: Config) -> list[str]:
    problems = []
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        problems.append(
            f"model.path={cfg.model.path!r} is not an HF model folder (no config.json there): "
            "give the folder of config.json and the safetensors"
        )
    if cfg.trainer.init_from and not (Path(cfg.trainer.init_from) / "meta.json").is_file():
        problems.append(
            f"trainer.init_from={cfg.trainer.init_from!r} is not a checkpoint folder (no meta.json): "
            "give a folder written by `sft` or `train`"
        )
    critic_init = cfg.critic.init_from
    if critic_init and not (Path(critic_init) / "critic" / "model").is_dir():
        problems.append(
            f"critic.init_from={critic_init!r} holds no critic (no critic/model folder): give a whole-run "
            "checkpoint (checkpoints/step_N) of a run with algorithm.adv_estimator=gae"
        )
    if critic_init and cfg.algorithm.adv_estimator != "gae":
        problems.append(
            f"critic.init_from is set but algorithm.adv_estimator={cfg.algorithm.adv_estimator}: no critic runs"
        )
    if cfg.trainer.resume not in ("auto", "never") and not Path(cfg.trainer.resume).is_dir():
        problems.append(
            f"trainer.resume={cfg.trainer.resume!r} is neither 'auto', 'never' nor a checkpoint folder"
        )
    if not cfg.trainer.run_dir:
        problems.append("trainer.run_dir is empty: give the run folder (e.g. runs/my_run)")
    for key, value in (
        ("data.train_path", cfg.data.train_path),
        ("data.val_path", cfg.data.val_path),
        ("sft.data_path", cfg.sft.data_path),
    ):
        if value and not Path(value).is_file():
            problems.append(f"{key}={value!r} does not exist")
    index = cfg.tools.search_index_dir
    if index and not Path(index).is_dir():
        problems.append(f"tools.search_index_dir={index!r} is not a folder (build one: envs/tools/search.py)")
    return problems


def _check_parallel(cfg: Config) -> list[str]:
    p, c = cfg.parallel, cfg.critic
    problems = [f"parallel.vpp={p.vpp} needs parallel.pp > 1"] if p.vpp > 1 and p.pp == 1 else []
    own_layout = [f"critic.{k}={getattr(c, k)}" for k in ("tp", "pp", "vpp", "dp") if getattr(c, k)]
    if own_layout and c.placement != "separate":
        problems.append(
            f"{', '.join(own_layout)} set with critic.placement={c.placement}: a colocated critic runs "
            "on the actor's ranks at parallel.*; set critic.placement=separate for a layout of its own"
        )
    if c.placement == "separate" and cfg.algorithm.adv_estimator != "gae":
        problems.append(
            f"critic.placement=separate but algorithm.adv_estimator={cfg.algorithm.adv_estimator}: no critic runs"
        )
    if c.placement == "separate" and c.vpp > 1 and (c.pp or p.pp) == 1:
        problems.append(f"critic.vpp={c.vpp} needs a critic pipeline (critic.pp > 1)")
    return problems


def _check_async(cfg: Config) -> list[str]:
    """Asynchronous RL needs an off-policy correction; the correction needs IS weights."""
    algo, problems = cfg.algorithm, []
    if cfg.trainer.mode == "async":
        if algo.adv_estimator == "gae" and cfg.trainer.critic_warmup:
            problems.append(
                f"trainer.mode=async with trainer.critic_warmup={cfg.trainer.critic_warmup}: a warm-up "
                "step does not update the actor, and the staleness bound counts one actor version per "
                "step; set trainer.critic_warmup=0 (a critic warmed up in a sync run comes in with "
                "critic.init_from)"
            )
        if not algo.off_policy_loss:
            problems.append(
                "trainer.mode=async needs an off-policy correction: set algorithm.off_policy_loss=decoupled "
                "(or tis); without one the loss treats tokens sampled by older weights as on-policy"
            )
        if algo.dynamic_sampling:
            problems.append(
                "algorithm.dynamic_sampling=true is not supported with trainer.mode=async yet "
                "(a refilled group would break the admission order): set one of them off"
            )
        if algo.adv_estimator == "remax":
            problems.append(
                "algorithm.adv_estimator=remax is not supported with trainer.mode=async: its greedy "
                "baseline rollout would wait behind the batches generating ahead (use grpo, rloo or "
                "reinforce_plus_plus)"
            )
    if algo.off_policy_loss and algo.rollout_is == "none":
        problems.append(
            f"algorithm.off_policy_loss={algo.off_policy_loss} weights tokens by pi_prox/pi_engine but "
            "algorithm.rollout_is=none turns those weights off: use auto, token or sequence"
        )
    return problems


def _check_quantization(cfg: Config) -> list[str]:
    """QAT quantizes the actor as the rollout is quantized: the same family, the local spec."""
    qat, rollout = cfg.actor.qat, cfg.rollout.quantization
    if not qat:
        return []
    problems = []
    if not rollout or rollout.split("_")[0] != qat.split("_")[0]:
        problems.append(
            f"actor.qat={qat} needs a rollout quantized alike: set rollout.quantization to "
            f"{qat.split('_')[0]}_qdq or {qat} (it is {rollout!r})"
        )
    if cfg.model.transformer_impl == "te":
        problems.append(
            "actor.qat with model.transformer_impl=te: QAT fake-quantizes the local spec's linear layers "
            "only for now; use model.transformer_impl=local"
        )
    return problems


def _check_tools(cfg: Config) -> list[str]:
    """Each enabled tool is a built-in or a dotted path to a user's tool."""
    problems = []
    for name in cfg.tools.enabled:
        if name not in BUILTIN_TOOLS and "." not in name:
            near = difflib.get_close_matches(name, BUILTIN_TOOLS, n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            problems.append(
                f"tools.enabled: unknown tool {name!r}: {hint}use one of {', '.join(BUILTIN_TOOLS)} "
                "or a dotted path to a Tool (my_package.tools.MyTool)"
            )
    return problems


def _check_debug(cfg: Config) -> list[str]:
    hold = cfg.debug.hold_at
    phase, _, step = hold.partition(":")
    if hold and (phase not in KILL_PHASES or not step.isdigit()):
        return [f"debug.hold_at={hold!r}: write PHASE:STEP with PHASE one of {', '.join(KILL_PHASES)}"]
    return []


def _check_machine(cfg: Config) -> None:
    """Settings that need a GPU, refused on a driver without one that starts its own cluster.

    A driver that joins a cluster (`ray.address`) may run on a CPU-only head node: the run checks
    the cluster's GPUs before any worker starts (`check_cluster_gpus`). torch (1 s to import) is
    asked for a GPU only when a setting needs one."""
    if cfg.ray.address:
        return
    try:
        check_cluster_gpus(cfg, num_gpus=0)  # raises when a setting needs a GPU
    except ConfigError:
        import torch

        if not torch.cuda.is_available():
            raise


def check_cluster_gpus(cfg: Config, num_gpus: float) -> None:
    """Raise `ConfigError` when a setting needs a GPU and the cluster has `num_gpus` == 0."""
    if num_gpus > 0:
        return
    where = f"the Ray cluster at {cfg.ray.address}" if cfg.ray.address else "this machine"
    if cfg.model.fp8:
        raise ConfigError(
            f"model.fp8={cfg.model.fp8!r} needs Transformer Engine on a CUDA GPU and {where} has none: "
            "set model.fp8='' (off) on CPU"
        )
    if cfg.model.transformer_impl == "te":
        raise ConfigError(
            f"model.transformer_impl=te needs Transformer Engine on a CUDA GPU and {where} has none: "
            "use 'auto' or 'local'"
        )
    if cfg.rollout.quantization in ("fp8", "nvfp4_w4a16"):
        family = cfg.rollout.quantization.split("_")[0]
        raise ConfigError(
            f"rollout.quantization={cfg.rollout.quantization!r} needs a CUDA GPU and {where} has none: "
            f"use rollout.quantization={family}_qdq on CPU (the same quantized values, dequantized) or ''"
        )
