"""Benchmark: the quickstart's time to its first RL step against its slowest component started alone.

    .venv/bin/python bench/startup.py [--rounds 2] [key=value ...]

A run must start Ray, the Megatron ranks and the rollout engines; started one after the other
they add up, started together the run waits for the slowest. Measured here, each in a fresh
process, from that process's start (interpreter and imports included) until it is ready:

    ray       the run's lean local Ray cluster (`train.cluster.start_ray`), connected
    megatron  one Megatron rank as the run builds it (`MegatronWorker.setup`: torch.distributed,
              the actor from the HF folder, Megatron's DDP and optimizer), world size 1
    engine    one rollout engine as the run builds it (`RolloutWorker`: vLLM with the model, the
              tools, the agent loop)
    run       `python -m megatron_agent train` on the quickstart config (no SFT, one step, plots
              off) until its first RL step begins (`timing_s/startup/total` in its perf.json;
              the base model already made): inputs, Ray, workers, the first weight sync and the
              step-0 validation

`startup_ratio` = run / max(ray, megatron, engine): 1.0 would be a run that starts as fast as its
slowest part. Target: <= 1.3. One untimed engine start comes first (vLLM caches what it learns
about model classes: every start after a machine's first finds it warm). Rounds alternate
components and runs; medians are printed, then the run's own phases (from its perf.json) and the
last line `startup_ratio=X run_s=Y slowest_s=Z`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "quickstart" / "config.yaml"
BASE_OVERRIDES = ["sft.steps=0", "trainer.total_steps=1", "logging.plot=false", "trainer.dump_rollouts=false"]

# Each component in a process of its own; it prints READY <seconds since its process started>.
COMPONENT = r"""
import json, os, sys, time
from megatron_agent.train.startup import process_age  # psutil's start time is up to 1 s early
kind, cfg_path, run_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
out = os.fdopen(os.dup(1), "w")  # the workers send fds 1 and 2 to their log file
def ready():
    print("READY", process_age(), file=out, flush=True)
if kind == "ray":
    from megatron_agent.train.cluster import start_ray, stop_ray
    start_ray()
    ready()
    stop_ray()
    sys.exit(0)
from megatron_agent.config import config_to_dict, load_config, make_plan
cfg = load_config(cfg_path, [f"trainer.run_dir={run_dir}", *overrides])
plan = make_plan(cfg)
log = os.path.join(run_dir, "logs", f"{kind}_alone.log")
if kind == "megatron":
    from megatron_agent.platform.setup import _free_port
    from megatron_agent.train.megatron_worker import MegatronWorker
    worker = MegatronWorker(0, 1, log, config_to_dict(cfg), plan.to_dict())
    worker.setup("127.0.0.1", _free_port(), cfg.trainer.init_from)
else:
    from megatron_agent.train.rollout_worker import RolloutWorker
    worker = RolloutWorker(0, 1, log, config_to_dict(cfg), plan.to_dict())
ready()
os._exit(0)
"""


def component_seconds(kind: str, run_dir: Path, overrides: list[str], env: dict) -> float:
    """Seconds from the start of a fresh process until `kind` is ready in it."""
    proc = subprocess.run(
        [sys.executable, "-c", COMPONENT, kind, str(CONFIG), str(run_dir), json.dumps(overrides)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("READY "):
            return float(line.split()[1])
    raise RuntimeError(f"{kind} did not start (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run_seconds(run_dir: Path, overrides: list[str], env: dict) -> dict:
    """The perf.json of one quickstart run with `overrides` in `run_dir` (a fresh folder)."""
    cmd = [sys.executable, "-m", "megatron_agent", "train", "--config", str(CONFIG)]
    proc = subprocess.run(
        [*cmd, f"trainer.run_dir={run_dir}", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "perf.json").read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (components, then a run)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the quickstart config")
    args = parser.parse_args(argv)

    from megatron_agent.rollout.engine_env import engine_process_env
    from megatron_agent.train.megatron_worker import rank_threads

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # what the run gives each kind: an engine its process variables (`Trainer.start`), and the one
    # Megatron rank of a world of 1 every core for its threads (not the engine's variables)
    engine_env = {**env, **engine_process_env()}
    envs = {
        "ray": env,
        "megatron": {**env, "OMP_NUM_THREADS": str(rank_threads(1))},
        "engine": engine_env,
    }
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        tmp = Path(tmp)
        base = tmp / "base_model"  # the quickstart's model, made once (as a run's first start does)
        overrides = [*BASE_OVERRIDES, f"model.path={base}", *args.overrides]
        from megatron_agent.config import load_config
        from megatron_agent.models.tiny import make_quickstart_model

        make_quickstart_model(base, seed=load_config(str(CONFIG), []).trainer.seed)
        component_seconds("engine", tmp / "warmup", overrides, engine_env)  # untimed: a warm vLLM cache
        times: dict[str, list[float]] = {"ray": [], "megatron": [], "engine": [], "run": []}
        phases: dict[str, float] = {}
        for r in range(args.rounds):
            for kind in ("ray", "megatron", "engine"):
                folder = tmp / f"{kind}_{r}"
                times[kind].append(component_seconds(kind, folder, overrides, envs[kind]))
            perf = run_seconds(tmp / f"run_{r}", overrides, env)
            times["run"].append(perf["timing_s/startup/total"])
            phases = perf
            print(
                f"round {r + 1}: " + " ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()),
                flush=True,
            )
    median = {k: statistics.median(v) for k, v in times.items()}
    slowest = max(median["ray"], median["megatron"], median["engine"])
    print("alone (median s): " + ", ".join(f"{k} {median[k]:.1f}" for k in ("ray", "megatron", "engine")))
    print(
        "run phases of the last round (s): "
        + ", ".join(
            f"{k.split('/')[-1]} {v:.1f}" for k, v in phases.items() if k.startswith("timing_s/startup/")
        )
    )
    print(f"startup_ratio={median['run'] / slowest:.3f} run_s={median['run']:.2f} slowest_s={slowest:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
