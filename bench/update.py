"""Benchmark: our actor update against a plain PyTorch update of the same HF model (CPU, side by side).

What is timed, per round:

    ours   `PPOUpdate.run(batch, [all sequences], step)` of a single in-process Megatron rank (gloo,
           tp = pp = 1, the CPU redirection on), built as a worker builds it on the quickstart
           config: `policy_from_hf` (Megatron DDP, Megatron's optimizer), the LR scheduler and the
           update of `MegatronWorker.make_update`. One call is the whole RL update of a step:
           micro-batching, forward through the fused log-prob head, old log-probs taken from that
           forward (`RunPlan.old_logprobs_from_update`, as the quickstart runs), the PPO loss,
           backward, the step guard (observe + check), gradient clipping and the Adam step.
    plain  a hand-written loop on `transformers.LlamaForCausalLM` (attention "sdpa", fp32): the
           same sequences right-padded to [B, T] (no attention mask: with right padding a causal
           model needs none, as in ours), full logits -> log_softmax -> gather of the targets, the
           same PPO-shaped loss (ratio to the detached log-probs, clipped as the config says)
           token-averaged over the same response mask, backward, `clip_grad_norm_` to
           `actor.grad_clip`, `torch.optim.AdamW` with the actor's lr / betas / weight decay, and
           `zero_grad(set_to_none=True)`. It runs with the CPU redirection popped, as it would in a
           process of its own.

Both updates start from the same weights and see the same tokens in the same process with the
same thread count (`--threads`, default all cores). Rounds alternate (ours, plain, ours, plain,
...) so that load from other work hits both alike; after `--warmup` untimed rounds the median of
`--rounds` timed rounds of each is kept. `first_logp_maxdiff` is the largest difference between
the two models' log-probs of the response tokens in the first round (same weights then: it
shows that both compute the same thing).

Sizes (`--sizes`, both by default):

    quickstart  the quickstart's own tiny model (`make_quickstart_model`, hidden 128, 4 layers,
                vocabulary 640) on a quickstart-shaped batch: 8 prompts x 8 samples, prompts of
                36-44 tokens, responses of 15-40 (about 4.3k tokens).
    0.5b        a Qwen2.5-0.5B-shaped Llama (hidden 896, 24 layers, 14 heads / 2 KV heads of 64,
                FFN 4864, vocabulary 151,936, tied embeddings; random weights) on `--seqs-0.5b`
                sequences of about 64 tokens (8: about 550 tokens), 1 warm-up and 2 timed rounds
                by default (a round of both takes about 30 s on 2 cores, the whole size about
                2.5 min). Both models, their gradients and Adam states are held at once: a peak
                of about 18.5 GiB resident.

One line per size, `size=... ours_s=... plain_s=... update_ratio=... tokens=...`, then the last
line `update_ratio=X update_ratio_0.5b=Y` (update_ratio: ours_s / plain_s; the quickstart's
is `update_ratio`). Target: update_ratio <= 1.3 at both sizes.

Run: .venv/bin/python bench/update.py [--sizes quickstart,0.5b] [--rounds N] [--warmup N] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUICKSTART_CONFIG = REPO / "examples" / "quickstart" / "config.yaml"
SAMPLES_PER_PROMPT = 8  # the quickstart's rollout.n


@dataclass(frozen=True)
class Size:
    """One model size of the benchmark and the batch it is timed on."""

    num_seqs: int
    """Sequences in the batch (groups of `SAMPLES_PER_PROMPT` share a prompt)."""
    prompt_tokens: tuple[int, int]
    """Inclusive range of prompt lengths."""
    response_tokens: tuple[int, int]
    """Inclusive range of response lengths (the loss-bearing part)."""
    warmup: int
    """Untimed rounds first (each round: one update of each kind)."""
    rounds: int
    """Timed rounds (the median of each kind is reported)."""


SIZES = {
    "quickstart": Size(64, (36, 44), (15, 40), warmup=2, rounds=7),
    "0.5b": Size(8, (28, 36), (24, 40), warmup=1, rounds=2),
}


def make_model(size: str, out_dir: Path) -> Path:
    """Write the HF model of `size` (config.json + safetensors) into `out_dir`; returns the folder."""
    import torch

    if size == "quickstart":
        from megatron_agent.models.tiny import make_quickstart_model

        return make_quickstart_model(out_dir, seed=0)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    del model
    gc.collect()
    return out_dir


def make_batch(spec: Size, vocab_size: int, seed: int = 0):
    """A quickstart-shaped `RLBatch`: prompts shared by groups of samples, loss on responses only.

    Per-target rows [L - 1] as the trainer hands them to the update: `loss_mask`, `rollout_logp`
    (near a random model's log-prob, so that the guard lets the step through), `policy_version`
    and `advantages` (one normal value per sequence on its response targets). No `old_logp`: the
    update takes it from its own forward. Returns (batch, prompt length of each sequence).
    """
    import torch

    from megatron_agent.train.batch import RLBatch

    g = torch.Generator().manual_seed(seed)

    def randint(lo_hi: tuple[int, int]) -> int:
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=g))

    sequences, prompt_lens, group_ids = [], [], []
    for k in range(spec.num_seqs):
        if k % SAMPLES_PER_PROMPT == 0:
            prompt = torch.randint(0, vocab_size, (randint(spec.prompt_tokens),), generator=g).tolist()
        response = torch.randint(0, vocab_size, (randint(spec.response_tokens),), generator=g).tolist()
        sequences.append(prompt + response)
        prompt_lens.append(len(prompt))
        group_ids.append(f"task{k // SAMPLES_PER_PROMPT}")
    batch = RLBatch(
        uids=[f"{gid}/{k % SAMPLES_PER_PROMPT}" for k, gid in enumerate(group_ids)],
        group_ids=group_ids,
        sequences=sequences,
        rewards=torch.rand(spec.num_seqs, generator=g),
    )
    masks, rollout, versions, advantages = [], [], [], []
    for seq, p in zip(sequences, prompt_lens):
        mask_T = torch.zeros(len(seq) - 1)
        mask_T[p - 1 :] = 1.0  # target j predicts token j + 1: the response's tokens
        masks.append(mask_T)
        noise_T = 0.1 * torch.randn(len(seq) - 1, generator=g)
        rollout.append((-math.log(vocab_size) + noise_T) * mask_T)
        versions.append(torch.where(mask_T.bool(), 0.0, -1.0))
        advantages.append(float(torch.randn((), generator=g)) * mask_T)
    batch.tensors.update(
        loss_mask=masks, rollout_logp=rollout, policy_version=versions, advantages=advantages
    )
    return batch, prompt_lens


class OursUpdate:
    """The actor and its `PPOUpdate` as a Megatron worker builds them on the quickstart config."""

    def __init__(self, model_dir: Path, run_dir: str, total_optimizer_steps: int):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_agent.build_policy import policy_from_hf
        from megatron_agent.config import load_config, make_plan
        from megatron_agent.train.megatron_worker import (
            build_options,
            optimizer_config,
            ppo_update,
            scheduler_options,
        )

        self.cfg = cfg = load_config(
            QUICKSTART_CONFIG, [f"trainer.run_dir={run_dir}", f"model.path={model_dir}"]
        )
        self.plan = plan = make_plan(cfg)
        self.actor = policy_from_hf(
            model_dir, build_options(cfg), trainable=True, optim=optimizer_config(cfg)
        )
        # As MegatronWorker.make_update: Megatron's param groups carry min_lr=None otherwise.
        options = scheduler_options(cfg, total_optimizer_steps)
        for group in self.actor.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = options["max_lr"], options["min_lr"]
        scheduler = OptimizerParamScheduler(self.actor.optimizer, **options)
        self.update = ppo_update(cfg, plan, self.actor, scheduler, console=False)

    def step(self, batch, step: int) -> tuple[float, dict[int, object]]:
        """One RL update of the whole batch (one mini-batch); (seconds, captured old log-probs)."""
        import torch

        start = time.perf_counter()
        sums = self.update.run(batch, [list(range(len(batch)))], step)
        seconds = time.perf_counter() - start
        if sums.get("guard/skipped") or sums.get("n_optimizer_steps") != 1.0:
            raise RuntimeError(f"our update skipped its optimizer step at step {step}: {sums}")
        captured = self.update.captured
        return seconds, {i: torch.from_numpy(row) for i, row in zip(captured["indices"], captured["old"])}


class PlainUpdate:
    """A hand-written PyTorch update of `LlamaForCausalLM` with the same loss, clip and Adam."""

    def __init__(self, model_dir: Path, batch, prompt_lens: list[int], cfg):
        import torch
        from transformers import LlamaForCausalLM

        from megatron_agent.train.megatron_worker import optimizer_config

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        optim = optimizer_config(cfg)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=(optim.adam_beta1, optim.adam_beta2),
            weight_decay=optim.weight_decay,
        )
        self.grad_clip = optim.grad_clip
        self.clip_low, self.clip_high = cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high
        width = max(len(s) for s in batch.sequences)
        self.ids_BS = torch.zeros((len(batch), width), dtype=torch.long)
        for b, seq in enumerate(batch.sequences):
            self.ids_BS[b, : len(seq)] = torch.tensor(seq)
        self.mask_BT = batch.padded("loss_mask")
        self.adv_BT = batch.padded("advantages")
        self.prompt_lens = prompt_lens

    def step(self) -> tuple[float, object]:
        """One update; (seconds, the response log-probs [B, T] before the step)."""
        import torch

        from megatron_agent.platform import cuda_on_cpu

        # The redirection's TorchFunctionMode sees every torch call; a plain process has none.
        popped = (
            torch.overrides._pop_mode_temporarily() if cuda_on_cpu.is_enabled() else contextlib.nullcontext()
        )
        with popped:
            start = time.perf_counter()
            logits_BSV = self.model(input_ids=self.ids_BS).logits
            logp_BTV = torch.log_softmax(logits_BSV[:, :-1].float(), dim=-1)
            logp_BT = logp_BTV.gather(-1, self.ids_BS[:, 1:].unsqueeze(-1)).squeeze(-1)
            ratio_BT = torch.exp(logp_BT - logp_BT.detach())
            clipped_BT = ratio_BT.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
            loss_BT = torch.maximum(-self.adv_BT * ratio_BT, -self.adv_BT * clipped_BT)
            loss = (loss_BT * self.mask_BT).sum() / self.mask_BT.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - start
        return seconds, logp_BT.detach()


def logp_maxdiff(batch, ours_old: dict[int, object], plain_logp_BT) -> float:
    """Largest |ours - plain| log-prob over the response targets of every sequence."""
    worst = 0.0
    for b, mask_T in enumerate(batch.tensors["loss_mask"]):
        on = mask_T.bool()
        n = len(mask_T)
        worst = max(worst, float((ours_old[b][on] - plain_logp_BT[b, :n][on]).abs().max()))
    return worst


def peak_rss_gib() -> float:
    """The process's peak resident memory so far (GiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_size(size: str, args) -> dict:
    """Build both updates of `size`, alternate their rounds, and return the medians."""
    spec = SIZES[size]
    num_seqs = args.seqs_05b if size == "0.5b" else spec.num_seqs
    spec = Size(num_seqs, spec.prompt_tokens, spec.response_tokens, spec.warmup, spec.rounds)
    warmup = spec.warmup if args.warmup is None else args.warmup
    rounds = spec.rounds if args.rounds is None else args.rounds
    with tempfile.TemporaryDirectory(prefix=f"bench_update_{size}_") as tmp:
        start = time.perf_counter()
        model_dir = make_model(size, Path(tmp) / "model")
        vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        batch, prompt_lens = make_batch(spec, vocab_size)
        ours = OursUpdate(model_dir, str(Path(tmp) / "run"), total_optimizer_steps=warmup + rounds)
        plain = PlainUpdate(model_dir, batch, prompt_lens, ours.cfg)
        build_s = time.perf_counter() - start
        if not ours.plan.old_logprobs_from_update:
            raise AssertionError("the quickstart plan no longer takes old log-probs from the update")
        ours_s, plain_s, maxdiff = [], [], float("nan")
        for r in range(warmup + rounds):
            o_s, ours_old = ours.step(batch, step=r + 1)
            p_s, plain_logp_BT = plain.step()
            if r == 0:  # both models still have the initial weights
                maxdiff = logp_maxdiff(batch, ours_old, plain_logp_BT)
            if r >= warmup:
                ours_s.append(o_s)
                plain_s.append(p_s)
            print(
                f"  {size} round {r + 1}{' (warm-up)' if r < warmup else ''}: ours {o_s:.3f} s, plain {p_s:.3f} s",
                flush=True,
            )
        result = {
            "ours_s": statistics.median(ours_s),
            "plain_s": statistics.median(plain_s),
            "tokens": sum(len(s) for s in batch.sequences),
            "rounds": rounds,
            "maxdiff": maxdiff,
            "build_s": build_s,
            "peak_rss_gib": peak_rss_gib(),
        }
        del ours, plain
        gc.collect()
    result["update_ratio"] = result["ours_s"] / result["plain_s"]
    assert math.isfinite(result["update_ratio"]) and result["update_ratio"] > 0
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="quickstart,0.5b", help="comma-separated: quickstart, 0.5b")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (quickstart 7, 0.5b 2)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds first (quickstart 2, 0.5b 1)"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for both")
    parser.add_argument("--seqs-0.5b", dest="seqs_05b", type=int, default=8, help="sequences at 0.5b")
    args = parser.parse_args(argv)
    asked = {s.strip() for s in args.sizes.split(",") if s.strip()}
    unknown = sorted(asked - set(SIZES))
    sizes = [s for s in SIZES if s in asked]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    if (args.rounds is not None and args.rounds < 1) or (args.warmup is not None and args.warmup < 0):
        parser.error("--rounds must be >= 1 and --warmup >= 0")

    import torch
    import transformers

    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    init_model_parallel(1, 1)  # one in-process rank (gloo); turns the CPU redirection on
    print(
        f"torch={torch.__version__} threads={torch.get_num_threads()} config={QUICKSTART_CONFIG.relative_to(REPO)}",
        flush=True,
    )
    results = {}
    try:
        for size in sizes:
            r = results[size] = run_size(size, args)
            print(
                f"size={size} ours_s={r['ours_s']:.4f} plain_s={r['plain_s']:.4f} "
                f"update_ratio={r['update_ratio']:.3f} tokens={r['tokens']} rounds={r['rounds']} "
                f"first_logp_maxdiff={r['maxdiff']:.2e} build_s={r['build_s']:.1f} "
                f"peak_rss_gib={r['peak_rss_gib']:.1f}",
                flush=True,
            )
    finally:
        destroy_model_parallel()
    keys = {"quickstart": "update_ratio", "0.5b": "update_ratio_0.5b"}
    print(" ".join(f"{keys[s]}={results[s]['update_ratio']:.3f}" for s in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
