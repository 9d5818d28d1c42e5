"""One Megatron rank as a Ray actor: the actor (trainable) and the frozen reference, colocated.

The driver creates `world = tp * pp * dp` of these (`cluster.WorkerGroup`), gives them one
rendezvous address, and then calls the same method on all of them at once: the pipeline
schedule and every collective need the whole world. Results come back from the ranks that
`report` (the last pipeline stage's TP rank 0 of each data-parallel replica); other ranks
return None.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import torch

from megatron_agent.config import Config, RunPlan, config_from_dict
from megatron_agent.models.build import BuildOptions
from megatron_agent.train.critic_role import CRITIC_DIR, CriticRole
from megatron_agent.train.drills import DrillPlan, Drills


def rank_threads(num_ranks: int) -> int:
    """Threads for each of `num_ranks` Megatron ranks sharing this machine's cores on CPU (what
    the driver gives every rank as OMP_NUM_THREADS)."""
    return max(1, (os.cpu_count() or 1) // num_ranks)


def build_options(cfg: Config, layout: tuple[int, ...] = ()) -> BuildOptions:
    """How the models are built: the `model` section at the parallel layout `parallel.*`, or at
    `layout` = (tp, pp, vpp, ...) (a separate critic's, `RunPlan.critic_layout`)."""
    m = cfg.model
    tp, pp, vpp = layout[:3] if layout else (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp)
    return BuildOptions(
        tp=tp,
        pp=pp,
        vpp=vpp,
        dtype=m.dtype,
        fp8=m.fp8,
        transformer_impl=m.transformer_impl,
        recompute=m.recompute,
    )


def optimizer_config(cfg: Config):
    """The actor's `OptimConfig` (the `actor` section): learning rate, decay, clip, sharding."""
    from megatron_agent.models.policy import OptimConfig

    a = cfg.actor
    return OptimConfig(
        lr=a.lr,
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        use_distributed_optimizer=a.use_distributed_optimizer,
    )


def scheduler_options(cfg: Config, total_optimizer_steps: int, section: str = "actor") -> dict:
    """Keyword arguments of the `OptimizerParamScheduler` of the actor (the `actor` section), or
    of the critic (`section="critic"`), for a run of `total_optimizer_steps`."""
    if section == "critic":
        c = cfg.critic
        return _schedule(c.lr, c.min_lr, c.lr_warmup_steps, c.lr_decay, c.weight_decay, total_optimizer_steps)
    a = cfg.actor
    return _schedule(a.lr, a.min_lr, a.lr_warmup_steps, a.lr_decay, a.weight_decay, total_optimizer_steps)


def _schedule(lr: float, min_lr: float, warmup: int, decay: str, weight_decay: float, total: int) -> dict:
    # `decay` is a Literal of the config: checked when it was loaded
    return dict(
        init_lr=0.0 if warmup else lr,
        max_lr=lr,
        min_lr=min_lr if decay != "constant" else lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total, warmup + 1),
        lr_decay_style=decay,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(total, 1),
        wd_incr_style="constant",
    )


def ppo_update(cfg: Config, plan: RunPlan, model, scheduler, *, console: bool):
    """The RL update of `model`: its step guard (`algorithm.guard_*`) and the `PPOUpdate`."""
    from megatron_agent.rl import StepGuard
    from megatron_agent.train.actor_update import PPOUpdate

    guard = StepGuard.from_config(cfg.algorithm, cfg.trainer.run_dir)
    guard.console = console
    return PPOUpdate(
        model,
        cfg.algorithm,
        cfg.actor,
        guard,
        scheduler,
        horizon=cfg.rollout.max_total_tokens,
        old_from_update=plan.old_logprobs_from_update,
        rollout_is=None if plan.rollout_is == "none" else (plan.rollout_is, plan.rollout_is_mode),
        chunk_tokens=cfg.model.logprob_chunk_tokens,
    )


def rollout_dtype(cfg: Config) -> torch.dtype:
    """The dtype the rollout engines serve (`model.dtype`): what the weight sync sends."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.model.dtype]


class MegatronRank:
    """What every Megatron rank of a worker group has: its config and plan, liveness, and the
    join of its torch.distributed world (one world per group)."""

    def __init__(self, rank: int, world_size: int, log_path: str, cfg_dict: dict, plan_dict: dict):
        from megatron_agent.train.cluster import redirect_output

        redirect_output(log_path)
        self.rank, self.world_size = rank, world_size
        self.cfg = config_from_dict(cfg_dict)
        self.plan = RunPlan.from_dict(plan_dict)
        self.model_path = self.plan.model_path
        self.info = None

    def ping(self) -> int:
        """Liveness check; returns the rank."""
        return self.rank

    def rendezvous_address(self) -> tuple[str, int]:
        """(host IP, a free port) for torch.distributed's rendezvous (asked of rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def _join_world(self, master_addr: str, master_port: int, layout: tuple[int, ...]) -> None:
        """Join this group's torch.distributed world and make its model-parallel groups at
        `layout` = (tp, pp, vpp, ...). On CPU each rank takes OMP_NUM_THREADS threads (the driver
        shares the cores out among every Megatron rank)."""
        from megatron_agent.platform.parallel import init_model_parallel
        from megatron_agent.platform.setup import has_cuda

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray gives each actor its own CUDA_VISIBLE_DEVICES
        )
        if not has_cuda():
            threads = os.environ.get("OMP_NUM_THREADS", "")
            torch.set_num_threads(int(threads) if threads.isdigit() else rank_threads(self.world_size))
        tp, pp, vpp = layout[:3]
        init_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=self.cfg.trainer.seed)

    @contextlib.contextmanager
    def _recording_save_error(self, path: str):
        """Around a checkpoint write: a failure is kept as this rank's reason (`last_save_error`,
        asked by the driver of every rank: Megatron raises the cause on one rank only) and raised
        as a RuntimeError naming `path`."""
        from megatron_agent.train.worker_state import save_error_message

        self.save_error = ""
        try:
            yield
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self.save_error = save_error_message(exc, path, self.rank)
            raise RuntimeError(self.save_error) from exc

    def last_save_error(self) -> str:
        """Why this rank's latest checkpoint write failed ('' when it did not); answers only when idle."""
        return getattr(self, "save_error", "")


class MegatronWorker(MegatronRank, CriticRole):
    """A Megatron rank holding the actor, the frozen reference and (`critic.placement=colocated`)
    the critic."""

    def __init__(self, rank: int, world_size: int, log_path: str, cfg_dict: dict, plan_dict: dict):
        super().__init__(rank, world_size, log_path, cfg_dict, plan_dict)
        self.drills = Drills(DrillPlan.from_config(self.cfg))  # no-ops unless debug.* is set
        self.actor = self.ref = self.update = self.sender = None
        self.sharing = None  # `ThreadSharing` with this machine's engines (`async.share_cores`)

    @property
    def has_critic(self) -> bool:
        """The critic lives on these ranks (a gae run with `critic.placement=colocated`)."""
        return self.plan.uses_critic and not self.plan.critic_layout

    def setup(self, master_addr: str, master_port: int, init_from: str = "") -> dict:
        """Join the torch.distributed world, build actor and reference, the optimizer and the guard.

        `init_from`: a checkpoint (e.g. from `sft`) whose weights replace those of the plan's
        model folder (`RunPlan.model_path`), for both
        the actor and the reference. Returns this rank's parallel info.
        """
        from megatron_agent.build_policy import policy_from_hf
        from megatron_agent.train.actor_update import parallel_info

        cfg, p, model_path = self.cfg, self.cfg.parallel, self.model_path
        self._join_world(master_addr, master_port, (p.tp, p.pp, p.vpp))
        opts = build_options(cfg)
        self.actor = self._new_actor(opts)
        self.critic = self._new_critic(opts) if self.has_critic else None
        # Without a KL term the reference is never read: it is not built.
        self.ref = policy_from_hf(model_path, opts, trainable=False) if self.plan.uses_reference else None
        if init_from:
            self._load_weights(init_from)
        self._load_critic_init()
        if self.ref is not None and cfg.model.ref_offload:
            self.ref.offload()
        self.info = parallel_info()
        return {
            "rank": self.rank,
            "dp_rank": self.info.dp_rank,
            "dp_size": self.info.dp_size,
            "reports": self.info.reports,
        }

    def _load_weights(self, ckpt_dir: str) -> None:
        from megatron_agent.checkpoint.model_io import load_checkpoint

        # sizes only: the driver hashed every file before any worker started (run.check_inputs_up_front),
        # or the checkpoint was just written by this run
        for model in (m for m in (self.actor, self.ref) if m is not None):
            load_checkpoint(ckpt_dir, model.chunks, model.arch, verify=False)
        if self.critic is not None:  # the transformer of the actor's checkpoint, its own head
            self._load_critic_transformer(ckpt_dir)

    # --------------------------------------------------------------------------------- RL
    def make_update(self, total_optimizer_steps: int) -> None:
        """Create the PPO update (guard, LR schedule) for a run of `total_optimizer_steps`."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        options = scheduler_options(self.cfg, total_optimizer_steps)
        for group in self.actor.optimizer.param_groups:
            # Megatron's param groups carry min_lr=None (OptimizerConfig.min_lr), which the
            # scheduler prefers over its own argument: a linear or cosine decay then fails.
            group["max_lr"], group["min_lr"] = options["max_lr"], options["min_lr"]
        scheduler = OptimizerParamScheduler(self.actor.optimizer, **options)
        self.update = ppo_update(self.cfg, self.plan, self.actor, scheduler, console=self.rank == 0)
        if self.critic is not None:
            self._make_critic_update()

    def logprobs(
        self, sequences: list[list[int]], with_old: bool = True, with_ref: bool = True
    ) -> dict | None:
        """Old (actor, with entropy) and/or reference log-probs of this replica's share, and timings."""
        import time

        from megatron_agent.train.actor_update import shard_logprobs

        tokens, chunk = self.cfg.actor.micro_batch_tokens, self.cfg.model.logprob_chunk_tokens
        start = time.perf_counter()
        indices, old, entropy, ref = None, None, None, None
        if with_old:
            indices, old, entropy = shard_logprobs(
                self.actor, sequences, micro_batch_tokens=tokens, with_entropy=True, chunk_tokens=chunk
            )
        mid = time.perf_counter()
        if with_ref:
            indices, ref, _ = shard_logprobs(
                self.ref, sequences, micro_batch_tokens=tokens, with_entropy=False, chunk_tokens=chunk
            )
        end = time.perf_counter()
        if not self.info.reports:
            return None
        return {
            "indices": indices,
            "old": old,
            "ref": ref,
            "entropy": entropy,
            "timing_s/old_log_prob": mid - start,
            "timing_s/ref": end - mid,
        }

    def train(self, batch, mini_batch_indices: list[list[int]], step: int) -> dict | None:
        """The PPO update of one RL step; metric sums on reporting ranks, None elsewhere."""
        with self.drills.around_update(self.actor, batch, step):
            sums = self.update.run(batch, mini_batch_indices, step, decode=self._decode)
        sums["actor/lr"] = self.update.current_lr()
        if self.sharing is not None:
            sums["async/rank_threads_low_share"] = self.sharing.low_share()
            self.sharing.restore()
        if self.rank == 0:
            self.drills.reached("update", step)
        if self.update.old_from_update:
            sums["captured"] = self.update.captured  # old log-probs and entropy of this forward
        return sums if self.info.reports else None

    def _decode(self, token_id: int) -> str:
        if not hasattr(self, "_tokenizer"):
            from megatron_agent.data.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer.decode([int(token_id)])

    # --------------------------------------------------------------------------------- SFT
    def sft_step(self, sequences: list[list[int]], loss_masks: list[list[int]], lr: float) -> dict | None:
        """One SFT optimizer step at learning rate `lr` on this replica's share (masked NLL)."""
        from megatron_agent.train.actor_update import parallel_info
        from megatron_agent.train.batch import dp_shard
        from megatron_agent.train.sft import sft_step

        info = parallel_info()
        mine = dp_shard(list(range(len(sequences))), info.dp_rank, info.dp_size)
        for group in self.actor.optimizer.param_groups:
            group["lr"] = lr
        metrics = sft_step(
            self.actor,
            [sequences[i] for i in mine],
            [loss_masks[i] for i in mine],
            micro_batch_tokens=self.cfg.actor.micro_batch_tokens,
            chunk_tokens=self.cfg.model.logprob_chunk_tokens,
        )
        return metrics if info.reports else None

    def _new_actor(self, opts):
        """The trainable actor from `self.model_path` with a fresh optimizer (the `actor` section)."""
        from megatron_agent.build_policy import policy_from_hf
        from megatron_agent.models.build import resolve_transformer_impl

        local_spec = resolve_transformer_impl(opts.transformer_impl) == "local"
        if self.plan.qat_format and not local_spec:  # model.transformer_impl=auto chose TE
            raise ValueError(
                "actor.qat wraps the local spec's linear layers only: set model.transformer_impl=local"
            )
        actor = policy_from_hf(self.model_path, opts, trainable=True, optim=optimizer_config(self.cfg))
        if self.plan.qat_format:  # its forward sees the rollout's quantized weights (quant/qat.py)
            from megatron_agent.quant.formats import format_named
            from megatron_agent.quant.qat import enable_qat

            fmt = format_named(self.plan.qat_format)
            enable_qat(actor.chunks, actor.arch, fmt, opts.tp)
            actor.qat_format = fmt  # the sync's probe then holds the rollout dtype's tolerance
        elif self.cfg.rollout.quantization and local_spec:
            self._quantized_probe(actor, opts.tp)
        return actor

    def _quantized_probe(self, actor, tp: int) -> None:
        """A quantized rollout without QAT: the actor's layers wrapped switched off, for the sync's
        probe to compute with the engines' quantized weights (quant/qat.py `quantized_forward`), so
        that it checks the sync and not the quantization's policy gap (which reached 1.49 nats on
        an unlikely token of an NVFP4 run)."""
        from megatron_agent.quant.formats import rollout_format
        from megatron_agent.quant.qat import enable_qat

        fmt, _ = rollout_format(self.cfg.rollout.quantization, self.cfg.rollout.fp8_scales)
        try:
            enable_qat(actor.chunks, actor.arch, fmt, tp, active=False)
            actor.probe_format = fmt
        except ValueError:  # tiles the layout splits: the probe measures the gap (sync.probe_tol_*)
            pass

    def restart_from(self, ckpt_dir: str) -> None:
        """Actor (with a fresh optimizer), reference and critic from `ckpt_dir` (after SFT)."""
        self.actor = self._new_actor(self.actor.opts)
        if self.critic is not None:
            self.critic = self._new_critic(self.actor.opts)
        self._load_weights(ckpt_dir)
        self._load_critic_init()
        self.sender = None

    # --------------------------------------------------------------------------------- weights
    def connect_engines(self, engine_handles: list, activity: list | None = None) -> None:
        """Create the weight sender towards the rollout engines (Ray actor handles). `activity`:
        the engines' `activity_handle()`s (`async.share_cores`): while one of this machine's
        engines generates, this rank computes on half its threads."""
        from megatron_agent.sync import RayEndpoint, WeightSender

        endpoints = [RayEndpoint(h, name=f"rollout engine {i}") for i, h in enumerate(engine_handles)]
        if self.sender is not None:  # reconnecting (a replaced engine): free its shared segment
            self.sender.close()
        self.sender = WeightSender(
            self.actor, self.cfg.sync, endpoints, rollout_dtype=rollout_dtype(self.cfg)
        )
        self._share_cores(activity or [])

    def _share_cores(self, activity: list) -> None:
        """Follow the activity of this machine's engines (`platform/core_sharing.py`), again
        from the start when they changed; nothing on GPU or with a single thread."""
        from megatron_agent.platform.setup import has_cuda

        if self.sharing is not None:
            self.sharing.close()  # its threads back to all of them first
            self.sharing = None
        if not any(activity) or has_cuda() or torch.get_num_threads() < 2:
            return
        import ray
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from megatron_agent.platform.core_sharing import ActivityWatch, ThreadSharing

        watch = ActivityWatch(activity, ray.get_runtime_context().get_node_id())
        if not len(watch):
            return
        self.sharing = ThreadSharing(watch, torch.get_num_threads())
        models = (m for m in (self.actor, self.ref, self.critic) if m is not None)
        self.sharing.install(
            layer
            for m in models
            for chunk in m.chunks
            for layer in chunk.modules()
            if isinstance(layer, TransformerLayer)
        )

    def close_sync(self) -> None:
        """Free the sync's shared memory (a killed actor cannot: Ray skips its exit handlers)."""
        if self.sender is not None:
            self.sender.close()

    def sync_weights(self, version: int | None = None) -> dict:
        """Collective: push the actor's weights into every engine, labelled `version` (default:
        one more than the engines had), and verify them."""
        return self.sender.sync(version)

    def save_checkpoint(self, ckpt_dir: str, hf_dir: str, extra_meta: dict | None = None) -> str:
        """Collective: the actor's weights as an atomic Megatron checkpoint (loads at any layout)."""
        from megatron_agent.checkpoint.model_io import save_checkpoint

        Path(ckpt_dir).parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(
            ckpt_dir, self.actor.chunks, self.actor.arch, hf_dir=hf_dir, overwrite=True, extra_meta=extra_meta
        )
        return ckpt_dir

    # --------------------------------------------------------------------------------- run state
    def save_state(self, ckpt_dir: str, hf_dir: str, driver_state: dict, critic_staged: str = "") -> str:
        """Collective: a whole-run checkpoint (weights, optimizer, scheduler, counters, RNG), atomic.

        `driver_state` (step, sampler, history, ...) is written by rank 0 to trainer/driver.json.
        `critic_staged`: the critic folder that a separate critic's ranks wrote for this
        checkpoint (`CriticWorker.save_critic`), moved into it before its manifest is written.
        """
        from megatron_agent.checkpoint.model_io import save_checkpoint
        from megatron_agent.train.run_state import DRIVER_FILE, STATE_DIR
        from megatron_agent.train.worker_state import rng_state, save_optimizer, trainer_state

        def write_optimizer(folder):
            save_optimizer(self.actor, folder)

        def write_critic(folder):  # weights, optimizer, schedule and guard of the critic
            if critic_staged:  # written by the critic's own ranks (critic.placement=separate)
                if self.rank == 0:
                    os.replace(critic_staged, folder)  # onto the empty folder made for it
                return
            for sub in ("model", "optim"):
                (folder / sub).mkdir(exist_ok=True)
            self._write_critic(folder)

        def write_trainer(folder):
            torch.save(rng_state(), folder / f"rng_rank{self.rank:05d}.pt")
            if self.rank == 0:
                torch.save(trainer_state(self.update), folder / "worker.pt")
                (folder / DRIVER_FILE).write_text(json.dumps(driver_state))
                self.drills.reached("save", driver_state["step"])

        Path(ckpt_dir).parent.mkdir(parents=True, exist_ok=True)
        with self._recording_save_error(ckpt_dir):
            save_checkpoint(
                ckpt_dir,
                self.actor.chunks,
                self.actor.arch,
                hf_dir=hf_dir,
                overwrite=True,
                extra_meta={"step": driver_state["step"], "run_state": True},
                extra_writers={
                    "optim": write_optimizer,
                    STATE_DIR: write_trainer,
                    **({CRITIC_DIR: write_critic} if self.critic is not None or critic_staged else {}),
                },
            )
        return ckpt_dir

    def load_state(self, ckpt_dir: str) -> int:
        """Collective: restore what `save_state` wrote (at any TP x PP layout); returns the step.

        The driver has verified every checksum already; here sizes are checked again. The
        update (`make_update`) must exist. A rank without its own RNG file (the layout grew)
        seeds from (trainer.seed, rank) and says so.
        """
        from megatron_agent.checkpoint.model_io import load_checkpoint
        from megatron_agent.train.run_state import STATE_DIR
        from megatron_agent.train.worker_state import load_optimizer, load_trainer_state, set_rng_state

        meta = load_checkpoint(ckpt_dir, self.actor.chunks, self.actor.arch, verify=False)
        load_optimizer(self.actor, Path(ckpt_dir) / "optim")
        folder = Path(ckpt_dir) / STATE_DIR
        load_trainer_state(self.update, torch.load(folder / "worker.pt", weights_only=False))
        if self.critic is not None:
            self._load_critic_state(ckpt_dir)
        set_rng_state(folder / f"rng_rank{self.rank:05d}.pt", seed=self.cfg.trainer.seed + self.rank)
        return int(meta["step"])
