"""Synchronous vs asynchronous RL on the quickstart with a long-tailed tool, measured side by side.

    .venv/bin/python bench/async.py [--steps 12] [--etas 1 2] [--rounds 1] [--tool-seed 0] [--unshared] [--out docs/async_curves.png] [key=value ...]

One SFT warm start (the quickstart's, `sft` command) is shared by every run; then the quickstart's
RL runs from it (`trainer.init_from`) three times in turn: `trainer.mode=sync` (the default loss,
what a user runs today), and `trainer.mode=async` with `algorithm.off_policy_loss=decoupled` at
each eta of `--etas`. Tool calls take a heavy-tailed time (bench/slow_tools.py: log-normal,
median 20 ms), drawn from one seed for every mode of a round (`--tool-seed`, plus the round's
index): the modes of a round meet the same sequence of delays, the rounds different ones. Per
run, over its RL steps:

    tokens/s       trained tokens (prompt + response) per second of step time
    engine idle    share of step time the engines did not generate (sync: outside `gen`;
                   async: `timing_s/wait_update`)
    trainer idle   share of step time the trainer waited for rollouts (sync: `gen`;
                   async: `timing_s/wait_rollout`)
    steps to 0.9   first validated step with val/accuracy >= 0.9 (validation every 2 steps)

`--unshared` adds, for each eta, a run with `async.share_cores=false` (the Megatron rank keeps
all its threads while the engine generates beside it) to every round, and its ratio to the last
line (`unshared_eta1=`, `unshared_eta2=`).

The last line: `speedup_eta1=X speedup_eta2=Y steps_ratio_eta1=Z` (async tokens/s over sync's,
and async's steps to 0.9 over sync's; with `--rounds N`, the median over N rounds, each running
every mode in turn: a sync run's generation waits for its batch's slowest tool call, so its step
time moves by tens of percent with the round's delays). `--out` draws the last round's validation
curves into one PNG.
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
CONFIG = "examples/quickstart/config.yaml"


def run(cmd: list[str], tool_seed: int | None = None) -> None:
    """Run a CLI command in the repository; raise with its tail on failure. `tool_seed`: the
    slow tool's latency seed (bench/slow_tools.py), the same for every mode of a round."""
    env = dict(os.environ, PYTHONPATH=str(REPO))  # the workers load bench.slow_tools
    if tool_seed is not None:
        env["BENCH_TOOL_LATENCY_SEED"] = str(tool_seed)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def figures(run_dir: Path, mode: str) -> dict:
    """tokens/s, idle shares, steps to 0.9 and the validation curve of one finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1 and "timing_s/step" in r]
    total = sum(r["timing_s/step"] for r in steps)
    tokens = sum(r["perf/throughput"] * r["timing_s/step"] for r in steps)
    if mode == "sync":
        engine_idle = sum(r["timing_s/step"] - r["timing_s/gen"] for r in steps)
        trainer_idle = sum(r["timing_s/gen"] for r in steps)
    else:
        engine_idle = sum(r["timing_s/wait_update"] for r in steps)
        trainer_idle = sum(r["timing_s/wait_rollout"] for r in steps)
    curve = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r and r["step"] >= 0]
    reached = next((s for s, acc in curve if acc >= 0.9), None)
    phases = {
        k: sum(r.get(f"timing_s/{k}", 0.0) for r in steps) / len(steps)
        for k in ("gen", "old_log_prob", "update_actor", "update_weights")
    }
    return {
        "phases": phases,
        "tokens_per_s": tokens / total,
        "engine_idle": engine_idle / total,
        "trainer_idle": trainer_idle / total,
        "steps_to_0.9": reached,
        "curve": curve,
        "step_s": total / len(steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--etas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=1, help="runs of every mode, in turn (ratios: median)")
    p.add_argument("--out", default="")
    p.add_argument("--tool-seed", type=int, default=0, help="latency seed of round 1 (round k: + k - 1)")
    p.add_argument("--unshared", action="store_true", help="also each eta with async.share_cores=false")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    py = sys.executable
    common = [
        f"trainer.total_steps={args.steps}",
        "trainer.test_freq=2",
        "tools.enabled=[bench.slow_tools.SlowCalculator]",
        "logging.plot=false",
        "logging.progress_bars=false",
        "checkpoint.save_freq=0",
        *args.overrides,
    ]
    modes = {"sync": []} | {
        f"eta{eta}": [
            "trainer.mode=async",
            f"async.max_staleness={eta}",
            "algorithm.off_policy_loss=decoupled",
        ]
        for eta in args.etas
    }
    if args.unshared:
        modes |= {f"eta{eta}-unshared": modes[f"eta{eta}"] + ["async.share_cores=false"] for eta in args.etas}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        sft_dir = Path(tmp) / "sft"
        run([py, "-m", "megatron_agent", "sft", "--config", CONFIG, f"trainer.run_dir={sft_dir}", *common])
        init = [f"trainer.init_from={sft_dir / 'sft' / 'checkpoint'}", "sft.steps=0"]
        for k in range(args.rounds):  # the modes in turn, so that a drift of the machine hits all
            results = {}
            for name, extra in modes.items():
                run_dir = Path(tmp) / f"{name}_{k}"
                base = [py, "-m", "megatron_agent", "train", "--config", CONFIG, f"trainer.run_dir={run_dir}"]
                run(base + common + init + extra, tool_seed=args.tool_seed + k)
                results[name] = figures(run_dir, "sync" if name == "sync" else "async")
            rounds.append(results)
            report(results, f"round {k + 1} of {args.rounds}")
    if args.out:
        draw(rounds[-1], args.out)

    def ratio(name: str, key: str) -> str:
        values = []
        for results in rounds:
            a, b = results.get(name, {}).get(key), results["sync"][key]
            if a is None or b is None:
                return "nan"
            values.append(a / b if key == "tokens_per_s" else a / max(b, 1))
        return f"{statistics.median(values):.2f}"

    unshared = "".join(
        f" unshared_eta{eta}={ratio(f'eta{eta}-unshared', 'tokens_per_s')}" for eta in (1, 2) if args.unshared
    )
    print(
        f"speedup_eta1={ratio('eta1', 'tokens_per_s')} speedup_eta2={ratio('eta2', 'tokens_per_s')} "
        f"steps_ratio_eta1={ratio('eta1', 'steps_to_0.9')}{unshared}"
    )


def report(results: dict, title: str) -> None:
    """One round's table, phases and validation curves."""
    print(f"-- {title}")
    print(
        f"{'run':13s} {'tokens/s':>9s} {'step s':>7s} {'engine idle':>12s} {'trainer idle':>13s} {'steps to 0.9':>13s}"
    )
    for name, r in results.items():
        print(
            f"{name:13s} {r['tokens_per_s']:9.1f} {r['step_s']:7.2f} {r['engine_idle']:12.2f} "
            f"{r['trainer_idle']:13.2f} {str(r['steps_to_0.9']):>13s}"
        )
    for name, r in results.items():
        print(f"mean s per step, {name}: " + " ".join(f"{k}={v:.2f}" for k, v in r["phases"].items()))
    for name, r in results.items():
        print(f"curve {name}: " + " ".join(f"{s}:{a:.2f}" for s, a in r["curve"]))
    sync = results["sync"]["tokens_per_s"]
    print(
        "speedups: "
        + " ".join(f"{n}={r['tokens_per_s'] / sync:.2f}" for n, r in results.items() if n != "sync")
    )


def draw(results: dict, out: str) -> None:
    """The validation curves of one round, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, r in results.items():
        ax.plot(*zip(*r["curve"]), marker="o", label=name)
    ax.set(xlabel="RL step", ylabel="val/accuracy", title="quickstart, long-tailed calculator")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()
