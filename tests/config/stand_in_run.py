"""A whole `Run(cfg).train()` in this process for the config-effects test: Ray, the Megatron ranks and the vLLM engine stood in for, everything else real."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import logging
import os
import re
import sys
import time
import types
import zlib
from pathlib import Path
from unittest import mock

import torch

from megatron_agent.config import Config
from megatron_agent.data.tasks import Task
from megatron_agent.train.batch import RLBatch
from tests.config.effects_probes import _Killed, _no_sandbox_probes, _safe_drills


# --------------------------------------------------------------------------------- the run
def _fake_logp(sequence) -> torch.Tensor:
    """Fixed per-target log-probs of a sequence (the stand-in ranks' old and reference log-probs)."""
    return torch.tensor([-0.2 - 0.05 * (t % 5) for t in sequence[1:]], dtype=torch.float32)


def _write_checkpoint(final: str, meta: dict, driver: dict | None = None, *, critic: bool = False) -> None:
    """A complete checkpoint folder (staging, manifest, rename), as `save_checkpoint` publishes it
    (`critic`: with a gae run's critic/ folder)."""
    from megatron_agent.checkpoint.manifest import write_manifest

    final_path = Path(final)
    staging = final_path.parent / f".{final_path.name}.tmp-fake"
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "weights").write_bytes(b"weights")
    if critic:
        (staging / "critic" / "model").mkdir(parents=True)
        (staging / "critic" / "model" / "weights").write_bytes(b"critic weights")
    if driver is not None:
        (staging / "trainer").mkdir()
        (staging / "trainer" / "driver.json").write_text(json.dumps(driver))
    (staging / "meta.json").write_text(json.dumps(meta))
    write_manifest(staging, fsync=False)
    if final_path.exists():
        import shutil

        shutil.rmtree(final_path)
    staging.rename(final_path)


class FakeRank:
    """A Megatron rank (`MegatronWorker`'s methods): fixed answers; checkpoints written to disk."""

    def __init__(self, rank, world_size, log_path, cfg_dict, plan_dict):
        from megatron_agent.config import RunPlan

        self.rank, self.world_size, self.plan = rank, world_size, RunPlan.from_dict(plan_dict)
        self.engines: list = []
        self.save_error = ""

    def rendezvous_address(self):
        return "127.0.0.1", 29500

    def setup(self, master_addr, master_port, init_from=""):
        return {"rank": self.rank, "dp_rank": 0, "dp_size": 1, "reports": self.rank == 0}

    def connect_engines(self, engines, activity=None):
        self.engines = engines  # the fake group's RolloutWorker objects
        self.activity = activity  # their activity handles (`async.share_cores`)

    def close_sync(self):
        pass

    def make_update(self, total_optimizer_steps):
        pass

    def restart_from(self, ckpt_dir):
        pass

    def logprobs(self, sequences, with_old=True, with_ref=True):
        if self.rank:
            return None
        old = [_fake_logp(s) for s in sequences]
        return {
            "indices": list(range(len(sequences))),
            "old": old if with_old else None,
            "ref": [x * 1.5 for x in old] if with_ref else None,
            "entropy": [torch.full_like(x, 0.5) for x in old] if with_old else None,
            "timing_s/old_log_prob": 0.0,
            "timing_s/ref": 0.0,
        }

    def values(self, sequences):
        if self.rank:
            return None
        rows = [0.1 * torch.arange(len(s) - 1, dtype=torch.float32) for s in sequences]
        return {"indices": list(range(len(sequences))), "values": rows, "timing_s/values": 0.0}

    def train_critic(self, batch, mini_batch_indices, step):
        if self.rank:
            return None
        out = {
            "critic/vf_loss": 0.1,
            "n_tokens": float(sum(m.sum() for m in batch.tensors["loss_mask"])),
            "n_optimizer_steps": float(len(mini_batch_indices)),
            "critic/lr": 1e-5,
            "timing_s/update_critic": 0.0,
        }
        if self.plan.values_from_update:  # the values of the update's forward (as `values` gives)
            out["captured"] = {
                "indices": list(range(len(batch))),
                "values": self.values(batch.sequences)["values"],
            }
        return out

    def train(self, batch, mini_batch_indices, step):
        if self.rank:
            return None
        out = {
            "actor/pg_loss": 0.0,
            "n_tokens": float(sum(m.sum() for m in batch.tensors["loss_mask"])),
            "n_optimizer_steps": float(len(mini_batch_indices)),
            "actor/lr": 1e-5,
        }
        if self.plan.old_logprobs_from_update:
            old = [_fake_logp(s) for s in batch.sequences]
            out["captured"] = {
                "indices": list(range(len(batch))),
                "old": old,
                "entropy": [torch.full_like(x, 0.5) for x in old],
            }
        return out

    def sync_weights(self, version=None):
        if self.rank == 0:
            for worker in self.engines:  # each engine's `finish`: the version it is given
                worker.engine.weight_version = (
                    worker.engine.weight_version + 1 if version is None else version
                )
        version = self.engines[0].engine.weight_version
        return {
            "sync/weight_version": float(version),
            "sync/verified": 1.0,
            "sync/probe_max_abs": 0.0,
            "sync/seconds": 0.0,
        }

    def sft_step(self, sequences, loss_masks, lr):
        return {"sft/loss": 1.0} if self.rank == 0 else None

    def save_checkpoint(self, ckpt_dir, hf_dir, extra_meta=None):
        if self.rank == 0:
            _write_checkpoint(ckpt_dir, dict(extra_meta or {}))
        return ckpt_dir

    def save_state(self, ckpt_dir, hf_dir, driver_state, critic_staged=""):
        self.save_error = ""
        try:
            Path(ckpt_dir).parent.mkdir(parents=True, exist_ok=True)
            if self.rank == 0:
                _write_checkpoint(ckpt_dir, {"step": driver_state["step"], "run_state": True}, driver_state)
        except OSError as exc:
            self.save_error = f"writing the checkpoint {ckpt_dir} failed on rank {self.rank}: {exc}"
            raise RuntimeError(self.save_error) from exc
        return ckpt_dir

    def last_save_error(self):
        return self.save_error

    def save_critic(self, folder):  # a separate critic's part of a checkpoint (CriticWorker)
        if self.rank == 0:
            (Path(folder) / "model").mkdir(parents=True)
        return folder

    def load_state(self, ckpt_dir):
        return int(json.loads((Path(ckpt_dir) / "meta.json").read_text())["step"])


class FakeEngine:
    """`VLLMEngine`'s interface: a reply per request picked by its seed (or arrival), each recorded."""

    REPLIES = (
        "<answer>4</answer>",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>',
        "I am not sure.",
    )

    def __init__(self, model_path, cluster, **kwargs):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.cluster, self.kwargs = cluster, kwargs
        self.weight_version, self._queue, self._count = 0, [], 0
        procs = [c.__name__ for c in kwargs.get("logits_processors", ())]
        cluster.record_engine("engine", "start", {**kwargs, "logits_processors": procs})

    @property
    def eos_token_id(self):
        return int(self.tokenizer.eos_token_id)

    def add_request(self, prompt_ids, sampling):
        self._count += 1
        self.cluster.record_engine("engine", "request", len(prompt_ids), dataclasses.asdict(sampling))
        self._queue.append((f"r{self._count}", list(prompt_ids), sampling))
        return f"r{self._count}"

    def step(self):
        """The oldest request, whole (like `HFEngine`)."""
        if not self._queue:
            return []
        rid, prompt, sampling = self._queue.pop(0)
        return [(rid, self._reply(prompt, sampling))]

    def _reply(self, prompt, sampling):
        from megatron_agent.rollout.engine import GenerationOutput

        eos = self.eos_token_id
        if sampling.extra_args:  # the forced-first-turn drill's script (scripted.py)
            from megatron_agent.rollout.scripted import FORCED_KEY

            ids = list(sampling.extra_args[FORCED_KEY]) + [eos]
        else:
            key = sampling.seed if sampling.seed is not None else self._count
            pick = 0 if sampling.temperature == 0 else zlib.crc32(f"{key}:{self.kwargs['seed']}".encode()) % 3
            ids = self.tokenizer.encode(self.REPLIES[pick], add_special_tokens=False) + [eos]
        finish, reason = "stop", None
        for i, t in enumerate(ids):
            if t in sampling.stop_token_ids:
                ids, reason = ids[: i + 1], t
                break
        if len(ids) > sampling.max_tokens:
            ids, finish, reason = ids[: sampling.max_tokens], "length", None
        logprobs = [-0.1 - 0.05 * (t % 7) for t in ids]
        return GenerationOutput(ids, logprobs, finish, reason, self.weight_version)

    def abort(self, request_ids):
        self._queue = [q for q in self._queue if q[0] not in request_ids]

    def has_unfinished_requests(self):
        return bool(self._queue)

    def reset_prefix_cache(self):
        self.cluster.record_engine("engine", "reset_prefix_cache")


class _Done:
    def __init__(self, results, error):
        self.results, self.error = results, error

    def result(self):
        if self.error is not None:
            raise self.error
        return self.results


class FakeGroup:
    """`cluster.WorkerGroup` in this process: the same calls and errors; the workers are objects."""

    def __init__(self, cluster, actor_cls, num_workers, *, name, log_dir, init_args=(), **options):
        worker_cls = FakeRank if actor_cls.__name__ in ("MegatronWorker", "CriticWorker") else actor_cls
        self.cluster, self.name = cluster, name
        self.make = lambda rank: worker_cls(rank, num_workers, f"{log_dir}/{name}_{rank}.log", *init_args)
        cluster.record(name, "start", num_workers, str(log_dir), options)
        self.workers = [self.make(rank) for rank in range(num_workers)]

    def __len__(self):
        return len(self.workers)

    def submit(self, method, *args, timeout_s=None, per_worker_args=None, ranks=None, **kwargs):
        from megatron_agent.train.cluster import WorkerDiedError, WorkerError

        ranks = list(range(len(self.workers))) if ranks is None else list(ranks)
        self.cluster.record(self.name, method, ranks, args, kwargs, timeout_s)
        results = []
        for i, rank in enumerate(ranks):
            worker_args = per_worker_args[i] if per_worker_args is not None else args
            try:
                results.append(getattr(self.workers[rank], method)(*worker_args, **kwargs))
            except _Killed as exc:
                died = WorkerDiedError(f"{self.name} worker rank {rank} died during {method}(): {exc}", rank)
                return _Done(None, died)
            except Exception as exc:  # noqa: BLE001 - what WorkerGroup reports of a raising worker
                return _Done(
                    None, WorkerError(f"{self.name} worker rank {rank} raised in {method}(): {exc!r}")
                )
        return _Done(results, None)

    def call(self, method, *args, **kwargs):
        return self.submit(method, *args, **kwargs).result()

    def replace(self, rank):
        self.cluster.record(self.name, "replace", rank)
        self.workers[rank] = self.make(rank)
        return self.workers[rank]

    def kill(self):
        self.cluster.record(self.name, "kill")


def _finish_together(calls: dict) -> dict[str, float]:
    """`cluster.finish_together` for `FakeGroup` calls (done already): their results, in order."""
    done = {}
    for name, call in calls.items():
        call.result()
        done[name] = time.perf_counter()
    return done


_CONFIGS: dict[str, Config] = {}


def _config_from_dict_once(data: dict) -> Config:
    """`config_from_dict`, each distinct dict rebuilt once (it evaluates the schema's annotations
    per field: a third of a run here), then copied."""
    from megatron_agent.config import config_from_dict

    key = json.dumps(data, sort_keys=True)
    if key not in _CONFIGS:
        _CONFIGS[key] = config_from_dict(data)
    return copy.deepcopy(_CONFIGS[key])


class FakeCluster:
    """Ray, the worker groups and wandb of one run, in this process; records what the run asks of them."""

    def __init__(self):
        self.calls: list = []
        self.engine_calls: list = []  # the engine's own, in its thread's order
        self.initialized = False

    def record(self, *what):
        self.calls.append(_summary(what))

    def record_engine(self, *what):
        """A call on the engine: it runs on the engine's thread, whose order relative to the
        driver's calls varies from run to run; its own order does not."""
        self.engine_calls.append(_summary(what))

    # the functions of `ray` the driver calls
    def init(self, **kwargs):
        self.record("ray", "init", kwargs)
        self.initialized = True

    def is_initialized(self):
        return self.initialized

    def shutdown(self):
        self.record("ray", "shutdown")
        self.initialized = False

    def cluster_resources(self):
        return {"CPU": 2.0}

    def wandb(self):
        cluster = self

        class Run:
            def define_metric(self, *args, **kwargs):
                pass

            def log(self, row):
                cluster.record("wandb", "log", row)

            def finish(self):
                cluster.record("wandb", "finish")

        def init(**kwargs):
            cluster.record("wandb", "init", {k: v for k, v in kwargs.items() if k != "settings"})
            return Run()

        module = types.ModuleType("wandb")
        module.init, module.Settings, module.teardown = init, lambda **kw: kw, lambda: None
        return module

    @contextlib.contextmanager
    def installed(self):
        """Ray, `WorkerGroup`, the engine and wandb replaced by this cluster's stand-ins."""
        import ray

        from megatron_agent.platform import run_token
        from megatron_agent.rollout import factory
        from megatron_agent.rollout.factory import engine_kwargs
        from megatron_agent.train import cluster, rollout_worker, trainer

        def build_engine(cfg, model_path, cache_dir=None, logits_processors=()):
            return FakeEngine(model_path, self, **engine_kwargs(cfg, cache_dir, logits_processors))

        patches = [
            mock.patch.object(ray, "init", self.init),
            mock.patch.object(ray, "is_initialized", self.is_initialized),
            mock.patch.object(ray, "shutdown", self.shutdown),
            mock.patch.object(ray, "put", lambda obj: obj),
            mock.patch.object(ray, "cluster_resources", self.cluster_resources),
            mock.patch.object(trainer, "WorkerGroup", lambda *a, **k: FakeGroup(self, *a, **k)),
            mock.patch.object(cluster, "redirect_output", lambda path: None),
            # no process of a run exists to reap or sweep (and a reaper's start-up would load the CPUs)
            mock.patch.object(run_token, "start_reaper", lambda: None),
            mock.patch.object(run_token, "sweep_dead_runs", lambda: []),
            mock.patch.object(cluster, "start_local_node", lambda num_cpus: None),  # ray.init's path
            mock.patch.object(cluster, "finish_together", _finish_together),
            mock.patch.object(factory, "build_engine", build_engine),
            mock.patch.object(rollout_worker, "config_from_dict", _config_from_dict_once),
            mock.patch.dict(os.environ),  # RolloutWorker sets TMPDIR
        ]
        previous = sys.modules.get("wandb")
        sys.modules["wandb"] = self.wandb()
        try:
            with contextlib.ExitStack() as stack:
                for p in patches:
                    stack.enter_context(p)
                yield self
        finally:
            if previous is None:
                del sys.modules["wandb"]
            else:
                sys.modules["wandb"] = previous


class _Terminal(io.StringIO):
    """Captured output that says it is a terminal (progress bars draw only on one)."""

    def isatty(self):
        return True


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


_TIMES = re.compile(r"^(timing_s|perf)/")


def _summary(x):
    """`x` as plain comparable values: batches, tasks and workers by their contents, timings dropped."""
    kind = type(x)
    if kind in (str, int, bool, type(None)):
        return x
    if kind is float:
        return x if x == x else "nan"  # NaN == NaN
    if kind in (list, tuple):
        if all(type(v) is int for v in x):  # token ids
            return list(x)
        return [_summary(v) for v in x]
    if kind is dict:
        return {str(k): _summary(v) for k, v in x.items() if not _TIMES.match(str(k))}
    if isinstance(x, torch.Tensor):
        return [v if v == v else "nan" for v in x.detach().float().flatten().tolist()]
    if isinstance(x, RLBatch):
        keys = ("uids", "group_ids", "sequences", "rewards", "tensors")
        return {k: _summary(getattr(x, k)) for k in keys}
    if isinstance(x, Task):
        return x.uid
    if isinstance(x, Path):
        return str(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _summary(dataclasses.asdict(x))
    if isinstance(x, type):
        return x.__name__
    return type(x).__name__  # a worker object handed on (connect_engines)


def _files(root: Path) -> dict[str, object]:
    """Files under `root`: contents' checksums where they are the run's products, else names only."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if "/tensorboard/" in rel:
            out[re.sub(r"/tensorboard/.*", "/tensorboard/<events>", rel)] = None
        elif "/rollouts/" in rel or "/base_model/" in rel:
            out[rel] = zlib.crc32(path.read_bytes())
        else:  # metrics.jsonl, checkpoints: they hold timings (their metrics are compared without)
            out[rel] = None
    return out


@contextlib.contextmanager
def _tiny_models_once(cache: dict, folder: Path):
    """`make_tiny_model` / `make_quickstart_model` made once per arguments, then copied (same files)."""
    import shutil

    from megatron_agent.models import tiny

    def once(make):
        def copy(out_dir, *args, **kwargs):
            key = (make.__name__, args, tuple(sorted(kwargs.items())))
            if key not in cache:
                cache[key] = make(folder / f"tiny_{len(cache)}", *args, **kwargs)
            shutil.copytree(cache[key], out_dir, dirs_exist_ok=True)
            return Path(out_dir)

        return copy

    with contextlib.ExitStack() as stack:
        for name in ("make_tiny_model", "make_quickstart_model"):
            stack.enter_context(mock.patch.object(tiny, name, once(getattr(tiny, name))))
        yield


def run_effects(cfg, env) -> dict:
    """`Run(cfg).train()` on the stand-in cluster: its status, worker calls, metrics, files and output."""
    from megatron_agent.train.run import Run
    from megatron_agent.train.run_log import read_metrics

    fake, out, err, records = FakeCluster(), _Terminal(), _Terminal(), _Records()
    log = logging.getLogger("megatron_agent")
    log.addHandler(records)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_safe_drills())
            stack.enter_context(_no_sandbox_probes())
            stack.enter_context(_tiny_models_once(*env["tiny"]))
            stack.enter_context(fake.installed())
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            status = Run(cfg).train()
    finally:
        log.removeHandler(records)
    metrics_path = Path(cfg.trainer.run_dir) / "metrics.jsonl"
    table = re.compile(r"^\s*(step\s|-?\d+\s)")  # the console table (its step_s is a timing)
    text, bar = err.getvalue().replace("\r", "\n"), re.compile(r"^[\w ]+:\s+\d+%")  # tqdm's bars
    return {
        "status": status,
        "calls": fake.calls,
        "engine_calls": fake.engine_calls,
        "metrics": _summary(read_metrics(metrics_path)) if metrics_path.exists() else None,
        "files": _files(Path.cwd()),
        "stdout": [line for line in out.getvalue().splitlines() if not table.match(line)],
        "bars": sorted(set(re.findall(r"^(rollout|update):\s+\d+%", text, re.M))),
        "stderr": [line for line in text.splitlines() if line.strip() and not bar.match(line)],
        "warnings": records.messages,
    }
