"""Measure the quickstart's SFT: make the model, SFT it (one process, TP1), export, evaluate.

    .venv/bin/python tests/train/sft_quickstart_probe.py --out runs/sft_probe [--seed 0 ...]

Greedy and sampled accuracy and tool-call rate come from the rollout command
(`python -m megatron_agent rollout`) on held-out `a op b` tasks. Prints one JSON line with
the numbers and writes it to `<out>/summary.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def export_hf(model, src_dir: Path, out_dir: Path) -> Path:
    """Write a TP1/PP1 live model as an HF folder (weights from `model`, side files from `src_dir`)."""
    from safetensors.torch import save_file

    from megatron_agent.weights.export import iter_hf_tensors

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().to("cpu", copy=True).contiguous()
        for name, t in iter_hf_tensors(model.chunks, model.arch)
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for p in src_dir.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy2(p, out_dir / p.name)
    return out_dir


def sft(args, base: Path) -> tuple[Path, dict]:
    from transformers import AutoTokenizer

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.data.sft import quickstart_sft_data, tokenize_rows
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import init_model_parallel
    from megatron_agent.train.sft import lr_at, set_lr, sft_batches, sft_step

    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = quickstart_sft_data(args.num_demos, seed=args.seed, tool_use_rate=args.rate)
    ids, masks, skipped = tokenize_rows(tokenizer, rows)
    init_model_parallel(1, 1, seed=args.seed)
    model = policy_from_hf(
        base, BuildOptions(), trainable=True, optim=OptimConfig(lr=args.lr, weight_decay=0.0)
    )
    start = time.monotonic()
    losses = []
    for step in range(args.steps):
        set_lr(model, lr_at(step, lr=args.lr, total_steps=args.steps, warmup_steps=args.warmup))
        batch = sft_batches(len(ids), args.batch, step, seed=args.seed)
        m = sft_step(
            model,
            [ids[k] for k in batch],
            [masks[k] for k in batch],
            micro_batch_tokens=args.micro_batch_tokens,
        )
        losses.append(m["sft/loss"])
        if step % 25 == 0 or step == args.steps - 1:
            print(
                f"sft step {step:4d} loss {m['sft/loss']:.4f} grad_norm {m['actor/grad_norm']:.3f} "
                f"lr {m['actor/lr']:.2e} ({time.monotonic() - start:.1f}s)",
                flush=True,
            )
    seconds = time.monotonic() - start
    out = export_hf(model, base, args.out / "sft")
    info = {
        "sft_seconds": round(seconds, 1),
        "sft_steps": args.steps,
        "sft_rows": len(ids),
        "sft_skipped": skipped,
        "sft_mean_tokens": sum(map(len, ids)) / len(ids),
        "sft_loss_first": losses[0],
        "sft_loss_last": sum(losses[-10:]) / len(losses[-10:]),
    }
    return out, info


def evaluate(model_dir: Path, tasks_path: Path, run_dir: Path, temperature: float, n: int) -> dict:
    """Accuracy and tool-call rate of the rollout command's dump."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "megatron_agent",
        "rollout",
        "--config",
        str(REPO / "examples/rollout_cpu.yaml"),
        "--model",
        str(model_dir),
        "--data",
        str(tasks_path),
        "--run-dir",
        str(run_dir),
        f"rollout.temperature={temperature}",
        f"rollout.n={n}",
        "trainer.dump_rollouts=true",
    ]
    start = time.monotonic()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"rollout command failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    rows = [json.loads(line) for line in open(run_dir / "rollouts" / "step_000000.jsonl")]
    return {
        "accuracy": sum(r["reward"] > 0.5 for r in rows) / len(rows),
        "tool_call_rate": sum(bool(r["tool_calls"]) for r in rows) / len(rows),
        "tool_ok_rate": sum(any(c["status"] == "ok" for c in r["tool_calls"]) for r in rows) / len(rows),
        "accuracy_given_tool": sum(r["reward"] > 0.5 for r in rows if r["tool_calls"])
        / max(1, sum(bool(r["tool_calls"]) for r in rows)),
        "num": len(rows),
        "seconds": round(time.monotonic() - start, 1),
    }


def main() -> None:
    from megatron_agent.train.sft import QUICKSTART_SFT

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=0.3)
    p.add_argument("--num-demos", type=int, default=2000)
    p.add_argument("--steps", type=int, default=QUICKSTART_SFT["steps"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=QUICKSTART_SFT["lr"])
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--eval-tasks", type=int, default=64)
    p.add_argument("--eval-seed", type=int, default=777)
    p.add_argument("--sampled-n", type=int, default=4)
    args = p.parse_args()
    from megatron_agent.data.sft import QUICKSTART_MAX_DEPTH
    from megatron_agent.data.synthetic import arithmetic_tasks
    from megatron_agent.data.tasks import write_tasks
    from megatron_agent.models.tiny import make_quickstart_model

    args.out.mkdir(parents=True, exist_ok=True)
    base = make_quickstart_model(args.out / "base", seed=args.seed)
    model_dir, info = sft(args, base)
    tasks = write_tasks(
        args.out / "val_tasks.jsonl", arithmetic_tasks(args.eval_tasks, args.eval_seed, QUICKSTART_MAX_DEPTH)
    )
    info["greedy"] = evaluate(model_dir, tasks, args.out / "eval_greedy", 0.0, 1)
    if args.sampled_n:
        info["sampled"] = evaluate(model_dir, tasks, args.out / "eval_sampled", 1.0, args.sampled_n)
    info["config"] = {k: str(v) for k, v in vars(args).items()}
    (args.out / "summary.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
