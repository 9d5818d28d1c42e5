"""Where the time of one RL step goes: generation, log-prob passes, advantages, update, sync, the rest.

    .venv/bin/python bench/step.py [--config examples/quickstart/config.yaml] [--steps 3] [--warmup 1]
        [--gae-steps N] [key=value ...]

Runs the real trainer in this process (the driver: `Trainer` + `rl_step`, as `train` does; Megatron
ranks and the vLLM engine are Ray actors) on the quickstart config with its batch sizes
(8 prompts x 8 samples, mini-batch 8); SFT is skipped (`sft.steps=0`; with `sft.steps=100`
the quickstart's SFT runs first, untimed, so that responses have the trained model's lengths and
tool calls), plots are off, and the run folder is a temporary one. After `--warmup` untimed steps, `--steps`
steps are timed; the table is the breakdown of the median one (the timed step of median
`timing_s/step`, so that the phases add up to it):

    gen            agent-loop rollouts (timing_s/gen)
    old_log_prob   actor forward on the worker (timing_s/old_log_prob)
    ref            reference forward on the worker (timing_s/ref)
    logprob_call   the driver's logprobs() call minus the two passes (Ray, batch transfer)
    adv            rewards, advantages, mismatch metrics (timing_s/adv)
    update         the PPO update, as the driver sees it (timing_s/update_actor)
    sync           weight sync into the engines, verified (timing_s/update_weights)
    rest           the step minus all of the above (batch building, metrics, rollout dump)

The sync's own breakdown (send, finish, probe) follows the table. Then a second run of the same
config with PPO's critic (`algorithm.adv_estimator=gae`, `--gae-steps` timed steps, default
`--steps`; 0 skips it) times, in each step, the critic's value pass and update beside the actor's
update at the same size and layout: `critic_ratio` = (timing_s/values + timing_s/update_critic)
/ timing_s/update_actor of its median step (target <= 1.1); on the quickstart's on-policy steps
the values come from the critic's update (no value pass: timing_s/values is absent, counted 0).
Extra `key=value` arguments are overrides of both runs (`critic.values=pass` times the value pass). The last line is
`overhead_ratio=X sync_share=Y step_s=S tree_rss_gb=M tree_pss_gb=P critic_ratio=C`: the share of the median
step's time outside generation and update, the sync's share, the median step's seconds, and the
peak memory of this process's tree (this driver, the Ray cluster it started, the Megatron ranks
and the engines: `platform/tree_memory.py`) summed as resident sets and as proportional sets
(shared pages once; of the first run only). Targets: overhead_ratio <= 0.15, sync_share <= 0.05. The figures before
issue 29's changes (`BEFORE`, measured with this script at commit e7ae4c8 on the same machine)
are printed next to them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# bench/step.py at e7ae4c8 (before the lean start-up and memory work), `--steps 5 sft.steps=100`,
# on the 2-core development machine: the median step and the tree's peak resident memory.
BEFORE = {"step_s": 1.014, "tree_rss_gb": 4.48}
PHASES = ["gen", "old_log_prob", "ref", "logprob_call", "adv", "update", "sync", "rest"]
SYNC_PARTS = ["sync/send_s", "sync/produce_s", "sync/pack_s", "sync/wait_s", "sync/finish_s", "sync/probe_s"]


def phases_of(row: dict) -> dict[str, float]:
    """Seconds per phase of one step's metrics (`rest` closes the sum to `timing_s/step`)."""
    old, ref = row.get("timing_s/old_log_prob", 0.0), row.get("timing_s/ref", 0.0)  # absent: not run
    out = {
        "gen": row["timing_s/gen"],
        "old_log_prob": old,
        "ref": ref,
        "logprob_call": max(0.0, row.get("bench/logprobs_call_s", 0.0) - old - ref),
        "adv": row["timing_s/adv"],
        "update": row["timing_s/update_actor"],
        "sync": row["timing_s/update_weights"],
    }
    out["rest"] = row["timing_s/step"] - sum(out.values())
    return out


def ratios_of(row: dict) -> tuple[float, float]:
    """(overhead_ratio, sync_share) of one step."""
    step = row["timing_s/step"]
    return (step - row["timing_s/gen"] - row["timing_s/update_actor"]) / step, row[
        "timing_s/update_weights"
    ] / step


def time_logprobs_call(trainer) -> None:
    """Record the driver-side wall time of `trainer.logprobs` in the timings it returns."""
    inner = trainer.logprobs

    def timed(batch):
        start = time.perf_counter()
        tensors, timings = inner(batch)
        return tensors, {**timings, "bench/logprobs_call_s": time.perf_counter() - start}

    trainer.logprobs = timed


def run_steps(config: str, overrides: list[str], num_warmup: int, num_steps: int) -> list[dict]:
    """Metrics of `num_warmup + num_steps` RL steps of a fresh trainer (warm-up rows first)."""
    from megatron_agent.config import load_config
    from megatron_agent.train.cluster import ray_cluster
    from megatron_agent.train.rl_loop import rl_step
    from megatron_agent.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="bench_step_")
    base = ["sft.steps=0", "logging.plot=false", "logging.progress_bars=false", f"trainer.run_dir={run_dir}"]
    cfg = load_config(config, [*base, *overrides])
    total = num_warmup + num_steps
    trainer = Trainer(cfg)
    rows = []
    with ray_cluster(cfg.ray.address, cfg.ray.num_cpus), contextlib.closing(trainer):
        trainer.start()
        if cfg.sft.steps > 0:  # as `train` does: SFT first, then RL from its checkpoint
            from megatron_agent.train.run_log import RunLogger
            from megatron_agent.train.sft_run import run_sft

            sft_log = RunLogger(trainer.run_dir / "sft_log", cfg.logging, stream=io.StringIO())
            try:
                ckpt = run_sft(trainer, sft_log, trainer.run_dir / "sft" / "checkpoint")
            finally:
                sft_log.close()
            trainer.actors.call("restart_from", str(ckpt))
            trainer.actors.call("connect_engines", trainer.engines.workers)
        trainer.make_update(total * cfg.actor.ppo_epochs * trainer.plan.num_mini_batches)
        first = trainer.sync()
        if first["sync/verified"] != 1.0:
            raise RuntimeError(
                "the initial weight sync was not verified; the benchmark would time a broken run"
            )
        time_logprobs_call(trainer)
        for step in range(1, total + 1):
            row = rl_step(trainer, step)
            if row["sync/verified"] != 1.0:
                raise RuntimeError(f"step {step}: the weight sync was not verified")
            rows.append(row)
            print(
                f"step {step}{' (warm-up)' if step <= num_warmup else ''}: {row['timing_s/step']:.2f} s, "
                f"{int(row['rollout/num_trajectories'])} trajectories, "
                f"response_length/mean {row['response_length/mean']:.1f}",
                flush=True,
            )
    return rows


def median_row(rows: list[dict]) -> dict:
    """The timed step of median `timing_s/step` (the lower one of an even count)."""
    ordered = sorted(rows, key=lambda r: r["timing_s/step"])
    return ordered[(len(ordered) - 1) // 2]


def report(rows: list[dict]) -> str:
    """The median step's phase seconds and shares, its sync breakdown, and the last line."""
    row = median_row(rows)
    phases, step_s = phases_of(row), row["timing_s/step"]
    lines = [f"median of {len(rows)} timed steps: step {row['step']}"]
    lines.append(f"{'phase':<14}{'seconds':>10}{'share':>8}")
    for name in PHASES:
        lines.append(f"{name:<14}{phases[name]:>10.3f}{phases[name] / step_s:>8.3f}")
    lines.append(f"{'step':<14}{step_s:>10.3f}{1.0:>8.3f}")
    parts = [f"{k.split('/')[1]}={row[k]:.3f}" for k in SYNC_PARTS if k in row]
    parts.append(f"MB={row['sync/bytes'] / 2**20:.1f}")
    lines.append("sync breakdown (s): " + " ".join(parts))
    lines.append(f"tokens in the step (prompt + response): {row['perf/throughput'] * step_s:.0f}")
    overhead, sync_share = ratios_of(row)
    assert math.isfinite(overhead) and math.isfinite(sync_share)
    lines.append(f"overhead_ratio={overhead:.4f} sync_share={sync_share:.4f}")
    return "\n".join(lines)


def critic_ratio(rows: list[dict]) -> tuple[float, str]:
    """(critic_ratio, a line of its parts) of the median step (by the ratio) of a gae run."""

    def ratio(r):
        return (r.get("timing_s/values", 0.0) + r["timing_s/update_critic"]) / r["timing_s/update_actor"]

    row = sorted(rows, key=ratio)[(len(rows) - 1) // 2]
    parts = " ".join(
        f"{k}={row.get('timing_s/' + k, 0.0):.3f}" for k in ("values", "update_critic", "update_actor")
    )
    if "timing_s/values" not in row:
        parts += " (values from the critic's update: critic.values=auto, RunPlan.values_from_update)"
    return ratio(row), f"critic (gae run, median of {len(rows)} steps, seconds): {parts}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "examples" / "quickstart" / "config.yaml"))
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median kept)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--gae-steps", type=int, default=None, help="timed steps of the gae run (0: none)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    from megatron_agent.platform.tree_memory import TreeMemory

    memory = TreeMemory(interval_s=0.5).start()
    rows = run_steps(args.config, args.overrides, args.warmup, args.steps)
    peak = memory.stop()
    gae_steps = args.steps if args.gae_steps is None else args.gae_steps
    critic = ""
    if gae_steps > 0:
        gae_rows = run_steps(
            args.config, [*args.overrides, "algorithm.adv_estimator=gae"], args.warmup, gae_steps
        )
        value, line = critic_ratio(gae_rows[args.warmup :])
        print(line)
        critic = f" critic_ratio={value:.3f}"
    step_s = median_row(rows[args.warmup :])["timing_s/step"]
    rss, pss = peak["perf/peak_rss_sum_gb"], peak["perf/peak_pss_sum_gb"]
    print(f"before (e7ae4c8): step_s={BEFORE['step_s']:.3f} tree_rss_gb={BEFORE['tree_rss_gb']:.2f}")
    print(
        f"{report(rows[args.warmup :])} step_s={step_s:.3f} tree_rss_gb={rss:.2f} tree_pss_gb={pss:.2f}{critic}"
    )


if __name__ == "__main__":
    main()
