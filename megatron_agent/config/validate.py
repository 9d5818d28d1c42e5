"""The one validation pass of a loaded config: every check that needs no worker.

Types and single-field choices are checked while the config is loaded (`load.py`); here are the
checks that involve several fields, the file system or the machine. Each error names the key and
the fix. The layout check against the model's heads and layers needs its `config.json`, so the
trainer runs it once the model folder exists (`train.trainer.check_layout`).
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_agent.config.schema import KILL_PHASES, Config, ConfigError


def validate_config(cfg: Config) -> None:
    """Raise `ConfigError` for the first setting that cannot work."""
    _check_sizes(cfg)
    _check_paths(cfg)
    _check_parallel(cfg)
    _check_machine(cfg)
    _check_async(cfg)
    hold = cfg.debug.hold_at
    phase, _, step = hold.partition(":")
    if hold and (phase not in KILL_PHASES or not step.isdigit()):
        raise ConfigError(
            f"debug.hold_at={hold!r}: write PHASE:STEP with PHASE one of {', '.join(KILL_PHASES)}"
        )


def _check_sizes(cfg: Config) -> None:
    a, d, p, r = cfg.actor, cfg.data, cfg.parallel, cfg.rollout
    for key, value in (
        ("data.train_batch_size", d.train_batch_size),
        ("rollout.n", r.n),
        ("actor.ppo_epochs", a.ppo_epochs),
        ("parallel.tp", p.tp),
        ("parallel.pp", p.pp),
        ("parallel.dp", p.dp),
        ("parallel.vpp", p.vpp),
        ("rollout.num_engines", r.num_engines),
        ("model.logprob_chunk_tokens", cfg.model.logprob_chunk_tokens),
        ("actor.micro_batch_tokens", a.micro_batch_tokens),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    mini = a.ppo_mini_batch_size or d.train_batch_size
    if d.train_batch_size % mini:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} is not divisible by actor.ppo_mini_batch_size={mini}: "
            f"choose a mini-batch size that divides it (e.g. {math.gcd(d.train_batch_size, mini)})"
        )
    if r.num_engines > d.train_batch_size:
        raise ConfigError(
            f"rollout.num_engines={r.num_engines} exceeds data.train_batch_size={d.train_batch_size}: "
            "fewer engines than prompts per step"
        )


def _check_paths(cfg: Config) -> None:
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(
            f"model.path={cfg.model.path!r} is not an HF model folder (no config.json there): "
            "give the folder of config.json and the safetensors"
        )
    if cfg.trainer.init_from and not (Path(cfg.trainer.init_from) / "meta.json").is_file():
        raise ConfigError(
            f"trainer.init_from={cfg.trainer.init_from!r} is not a checkpoint folder (no meta.json): "
            "give a folder written by `sft` or `train`"
        )
    for key, value in (("data.train_path", cfg.data.train_path), ("data.val_path", cfg.data.val_path)):
        if value and not Path(value).is_file():
            raise ConfigError(f"{key}={value!r} does not exist")


def _check_parallel(cfg: Config) -> None:
    p = cfg.parallel
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp={p.vpp} needs parallel.pp > 1")


def _check_async(cfg: Config) -> None:
    """Asynchronous RL needs an off-policy correction; the correction needs IS weights."""
    algo, eta = cfg.algorithm, cfg.async_.max_staleness
    if eta < 0:
        raise ConfigError(f"async.max_staleness={eta} must be >= 0 (0: the synchronous schedule)")
    if cfg.async_.interrupt_after_engine_steps < 1:
        raise ConfigError(
            f"async.interrupt_after_engine_steps={cfg.async_.interrupt_after_engine_steps} must be >= 1"
        )
    if cfg.trainer.mode == "async":
        if not algo.off_policy_loss:
            raise ConfigError(
                "trainer.mode=async needs an off-policy correction: set algorithm.off_policy_loss=decoupled "
                "(or tis); without one the loss treats tokens sampled by older weights as on-policy"
            )
        if algo.dynamic_sampling:
            raise ConfigError(
                "algorithm.dynamic_sampling=true is not supported with trainer.mode=async yet "
                "(a refilled group would break the admission order): set one of them off"
            )
        if algo.adv_estimator == "remax":
            raise ConfigError(
                "algorithm.adv_estimator=remax is not supported with trainer.mode=async: its greedy "
                "baseline rollout would wait behind the batches generating ahead (use grpo, rloo or "
                "reinforce_plus_plus)"
            )
    if algo.off_policy_loss and algo.rollout_is == "none":
        raise ConfigError(
            f"algorithm.off_policy_loss={algo.off_policy_loss} weights tokens by pi_prox/pi_engine but "
            "algorithm.rollout_is=none turns those weights off: use auto, token or sequence"
        )


def _check_machine(cfg: Config) -> None:
    """Settings that need a GPU, refused on a driver without one that starts its own cluster.

    A driver that joins a cluster (`ray.address`) may run on a CPU-only head node: the run checks
    the cluster's GPUs before any worker starts (`check_cluster_gpus`)."""
    if cfg.ray.address:
        return
    import torch

    if not torch.cuda.is_available():
        check_cluster_gpus(cfg, num_gpus=0)


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
    if cfg.rollout.quantization:
        raise ConfigError(
            f"rollout.quantization={cfg.rollout.quantization!r} needs a CUDA GPU and {where} has none: "
            "set rollout.quantization='' on CPU"
        )
