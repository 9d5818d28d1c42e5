"""`python -m megatron_agent rollout --config FILE key=value ...`: evaluate a model with the agent loop.

Generates `rollout.n` trajectories per task of the dataset (`data.val_path`, else
`data.train_path`, else synthetic tasks), writes the rollout dump
`<trainer.run_dir>/rollouts/step_{N:06d}.jsonl`, a metrics line in `<run_dir>/metrics.jsonl`, and
prints reward and tool statistics. With `model.path` empty a tiny random model is made in the
run folder (a smoke test of the machinery, not of a model).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from megatron_agent.errors import InputError

logger = logging.getLogger("megatron_agent.rollout")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_agent rollout", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("--model", default=None, help="HF model folder (overrides model.path)")
    parser.add_argument(
        "--data", default=None, help="task file, .jsonl or .parquet (overrides data.val_path)"
    )
    parser.add_argument("--run-dir", default=None, help="run folder (overrides trainer.run_dir)")
    parser.add_argument("--step", type=int, default=0, help="step number of the dump file name")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. rollout.n=2")
    return parser.parse_args(argv)


def _tasks(cfg, run_dir: Path):
    """(tasks to roll out, bad rows skipped, tool names, search index dir); the config is not changed."""
    from megatron_agent.data import synthetic
    from megatron_agent.data.tasks import load_tasks

    tools, index_dir = list(cfg.tools.enabled), cfg.tools.search_index_dir
    path = cfg.data.val_path or cfg.data.train_path
    if path:
        tasks, num_skipped = load_tasks(path)
        if not tasks:
            raise InputError(f"{path}: no valid task rows ({num_skipped} skipped, each named above)")
        return tasks, num_skipped, tools, index_dir
    if cfg.data.synthetic == "arithmetic":
        return (
            synthetic.arithmetic_tasks(cfg.data.num_synthetic_tasks, seed=cfg.data.seed),
            0,
            tools,
            index_dir,
        )
    # multihop: a corpus, its search index and questions; the search tool on that index
    tasks, _, made = synthetic.multihop_tasks(
        run_dir / "synthetic", cfg.data.num_synthetic_tasks, cfg.data.seed
    )
    return tasks, 0, tools if "search" in tools else [*tools, "search"], index_dir or str(made)


def _summary(metrics: dict, seconds: float) -> str:
    keys = [
        "rollout/num_trajectories",
        "critic/score/mean",
        "critic/score/max",
        "critic/score/min",
        "response_length/mean",
        "response_length/clip_ratio",
        "turns/mean",
        "tool/calls",
        "tool/errors",
        "tool/timeouts",
        "tool/truncated",
    ]
    lines = [f"{k:<28} {metrics[k]:.4g}" for k in keys if k in metrics]
    lines += [f"{k:<28} {v:.4g}" for k, v in metrics.items() if k.startswith(("tool/status/", "finish/"))]
    lines.append(f"{'timing_s/gen':<28} {seconds:.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the rollout command; returns the exit status."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from megatron_agent.config import load_config

    flags = {"model.path": args.model, "data.val_path": args.data, "trainer.run_dir": args.run_dir}
    overrides = [*args.overrides, *(f"{key}={value}" for key, value in flags.items() if value)]
    cfg = load_config(args.config, overrides)
    run_dir = Path(cfg.trainer.run_dir)
    tasks, num_skipped, tool_names, index_dir = _tasks(cfg, run_dir)  # refused before the run folder is made

    from megatron_agent.rollout import build_training_batch, rollout_metrics, write_rollout_dump
    from megatron_agent.rollout.factory import build_agent_loop, build_engine, build_toolset

    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TMPDIR", str(run_dir))
    model_path = cfg.model.path
    if not model_path:
        from megatron_agent.models.tiny import make_tiny_model

        model_path = str(make_tiny_model(run_dir / "tiny_model", cfg.model.tiny_family))
        logger.info(
            "model.path is empty: using a tiny random %s model in %s", cfg.model.tiny_family, model_path
        )
    tools = build_toolset(cfg, tool_names, index_dir)
    missing = sorted({t for task in tasks for t in task.tools} - set(tools.tools))
    if missing:
        logger.warning("tasks name tools that are not enabled (tools.enabled): %s", ", ".join(missing))
    engine = build_engine(cfg, model_path, cache_dir=str(run_dir))
    loop = build_agent_loop(cfg, engine, tools)
    start = time.monotonic()
    trajectories = loop.run(tasks, cfg.rollout.n)
    seconds = time.monotonic() - start
    loop.engine.close()
    build_training_batch(trajectories, pad_id=0)  # the provenance contract holds for every row
    metrics = rollout_metrics(trajectories)
    metrics["data/skipped_rows"] = float(num_skipped)
    metrics["timing_s/gen"] = seconds
    metrics["rollout/sampled_tokens_per_s"] = metrics["tokens/sampled"] / max(seconds, 1e-9)
    dump = write_rollout_dump(run_dir, args.step, trajectories) if cfg.trainer.dump_rollouts else None
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": args.step, **metrics}) + "\n")
    print(_summary(metrics, seconds))
    if dump is not None:
        print(f"rollout dump: {dump}")
    return 0
