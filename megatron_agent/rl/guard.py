"""The step guard: check loss, gradients and per-token log-ratios before each optimizer step,
skip the step on all ranks when something breached, and name the culprit tokens.

Use in the trainer, per mini-batch:

    guard = StepGuard(run_dir, GuardLimits(...), top_k=5, max_consecutive_skips=3)
    for micro_batch in micro_batches:
        ... forward, loss.backward() ...
        guard.observe(GuardBatch(logprob=logp_BT, old_logprob=..., advantages=..., loss_mask=...,
                                 rollout_logprob=..., token_ids=..., sample_ids=..., ...))
    decision = guard.check(step, loss=losses, parameters=model.parameters())
    if not decision.skip:
        optimizer.step()          # otherwise weights and optimizer state stay untouched
    optimizer.zero_grad()

`check` all-reduces the breach flags (MAX) over the process group, so every rank takes the same
decision. On a breach it writes `<run_dir>/guard/step_{N:06d}.json` (the limits, the reasons and
the top-k tokens by |log-ratio| and by loss contribution, each with sample id, turn, position,
token id and text, provenance, rollout / old / new / ref log-probs, advantage and loss mask),
prints a short table, and counts the skip; more than `max_consecutive_skips` breaches in a row
raise `GuardError` instead of training on garbage.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_agent.errors import RunFailure

_EXP_CLAMP = 20.0
# Per-token fields gathered for candidate tokens (float64 holds token ids exactly).
_FIELDS = (
    "logprob",
    "old_logprob",
    "rollout_logprob",
    "ref_logprob",
    "advantage",
    "loss_mask",
    "log_ratio",
    "loss_contribution",
    "token_id",
    "turn",
    "position",
)
# Criteria for ranking candidate tokens: report key, per-token score name.
_RANKINGS = (
    ("top_by_abs_log_ratio", "abs_log_ratio"),
    ("top_by_loss_contribution", "loss_contribution"),
    ("top_by_rollout_abs_log_ratio", "rollout_abs_log_ratio"),
    ("top_by_abs_kl", "abs_kl"),
)
# Local breach flags, in all-reduce order.
_REASONS = (
    "nonfinite_loss",
    "nonfinite_grad",
    "grad_norm",
    "nonfinite_tokens",
    "abs_log_ratio",
    "ratio",
    "rollout_abs_log_ratio",
    "abs_kl",
)


class GuardError(RunFailure):
    """Raised when more than `max_consecutive_skips` optimizer steps in a row breached the guard."""


@dataclass
class GuardLimits:
    """Limits checked before each optimizer step (None switches a limit off).

    Non-finite loss, gradients, and log-probs or advantages on loss tokens always breach.
    """

    max_abs_log_ratio: float | None = 20.0
    """Largest allowed |logprob - old_logprob| on a loss token."""
    max_ratio: float | None = None
    """Largest allowed exp(logprob - old_logprob) on a loss token."""
    max_rollout_abs_log_ratio: float | None = 20.0
    """Largest allowed |old_logprob - rollout_logprob| on a loss token (rollout vs trainer)."""
    max_abs_kl: float | None = None
    """Largest allowed |logprob - ref_logprob| on a loss token."""
    max_grad_norm: float | None = None
    """Largest allowed total gradient norm (before clipping)."""


@dataclass
class GuardBatch:
    """Per-token view of one micro-batch for the guard; tensors are [B, T] unless noted.

    Only the first four fields are required. Log-probs may be any float dtype and may require
    grad (the guard detaches them). `rollout_logprob` is NaN where the engine gave none.
    """

    logprob: torch.Tensor
    """The policy's log-probs from the current forward pass (the 'new' ones)."""
    old_logprob: torch.Tensor
    """The trainer's log-probs before the update."""
    advantages: torch.Tensor
    """Per-token advantages."""
    loss_mask: torch.Tensor
    """True where the token carries loss."""
    rollout_logprob: torch.Tensor | None = None
    """The rollout engine's log-probs of the sampled tokens."""
    ref_logprob: torch.Tensor | None = None
    """The reference model's log-probs."""
    token_loss: torch.Tensor | None = None
    """Per-token loss (e.g. from `token_policy_loss`); default |A| * exp(clamped log-ratio)."""
    token_ids: torch.Tensor | None = None
    """Token ids."""
    sample_ids: Sequence | None = None
    """One id per row [B] (the trajectory uid)."""
    turn_index: torch.Tensor | None = None
    """Assistant turn of each token."""
    positions: torch.Tensor | None = None
    """Position of each token in its response; default the column index."""
    token_source: Sequence[Sequence[str]] | None = None
    """Provenance per token ([B] lists of T strings): sampled, injected, tool, template."""
    response_mask: torch.Tensor | None = None
    """True on response tokens (with or without loss); counts `guard/num_masked_tokens`."""
    decode: Callable[[int], str] | None = None
    """Token id -> text, called only for the reported tokens."""


@dataclass
class GuardDecision:
    """What `StepGuard.check` decided for one optimizer step."""

    skip: bool
    """True: do not call optimizer.step() (all ranks got the same answer)."""
    reasons: list[str] = field(default_factory=list)
    """Breached checks on any rank, e.g. ['abs_log_ratio', 'nonfinite_grad']."""
    report_path: Path | None = None
    """The JSON culprit report (on the group's first rank; None when not skipped)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """`guard/*` metrics for this step."""


def _default_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _reduce_device(group, fallback: torch.device) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback.type == "cpu" else torch.device("cpu")


def _all_reduce(values: torch.Tensor, op, group) -> torch.Tensor:
    """All-reduce a small float64 vector over `group` (no-op without torch.distributed)."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    device = _reduce_device(group, values.device)
    out = values.to(device)
    dist.all_reduce(out, op=op, group=group)
    return out.cpu()


def agree_to_skip(local_breach: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when any rank of `group` breached (an all-reduce MAX of the flag).

    `group` defaults to the world when torch.distributed is initialised, else the decision is
    local.
    """
    group = group if group is not None else _default_group()
    flag = torch.tensor([1.0 if local_breach else 0.0], dtype=torch.float64)
    return bool(_all_reduce(flag, dist.ReduceOp.MAX, group)[0] > 0)


def _float(x: float) -> float | str | None:
    """JSON-safe float: non-finite values become 'nan' / 'inf' / '-inf'."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


class StepGuard:
    """Collects per-micro-batch token statistics and decides, per optimizer step, to skip or not.

    `run_dir`: where `guard/step_{N:06d}.json` reports go. `group`: the process group whose ranks
    must agree (default: the world when initialised, else local). `console`: print the culprit
    table on the group's first rank. `enabled=False` (algorithm.guard_enabled=false): nothing is
    observed and no step is skipped, not even a non-finite one.
    """

    def __init__(
        self,
        run_dir: str | Path,
        limits: GuardLimits | None = None,
        *,
        top_k: int = 5,
        max_consecutive_skips: int = 3,
        group: dist.ProcessGroup | None = None,
        console: bool = True,
        enabled: bool = True,
    ):
        if top_k < 1:
            raise ValueError(f"guard top_k must be >= 1, got {top_k}")
        if max_consecutive_skips < 0:
            raise ValueError(f"max_consecutive_skips must be >= 0, got {max_consecutive_skips}")
        self.run_dir = Path(run_dir)
        self.limits = limits or GuardLimits()
        self.top_k = top_k
        self.max_consecutive_skips = max_consecutive_skips
        self.group = group
        self.console = console
        self.enabled = enabled
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._reset()

    def _reset(self) -> None:
        self._stats: list[torch.Tensor] = []
        self._candidates: list[tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @classmethod
    def from_config(cls, algorithm, run_dir: str | Path, group: dist.ProcessGroup | None = None) -> StepGuard:
        """Build from an `AlgorithmConfig` (its `guard_*` fields)."""
        limits = GuardLimits(
            max_abs_log_ratio=algorithm.guard_max_abs_log_ratio,
            max_ratio=algorithm.guard_max_ratio,
            max_rollout_abs_log_ratio=algorithm.guard_max_rollout_abs_log_ratio,
            max_abs_kl=algorithm.guard_max_abs_kl,
            max_grad_norm=algorithm.guard_max_grad_norm,
        )
        return cls(
            run_dir,
            limits,
            top_k=algorithm.guard_top_k,
            max_consecutive_skips=algorithm.guard_max_consecutive_skips,
            group=group,
            enabled=algorithm.guard_enabled,
        )

    # ---- per micro-batch -------------------------------------------------------------------
    @torch.no_grad()
    def observe(self, batch: GuardBatch) -> None:
        """Record one micro-batch: maxima, counts and the top-k candidate tokens (stays on device)."""
        if not self.enabled:
            return
        mask = batch.loss_mask.bool()
        shape = mask.shape
        if mask.dim() != 2:
            raise ValueError(f"GuardBatch.loss_mask must be [B, T], got {tuple(shape)}")
        for name in ("logprob", "old_logprob", "advantages", "rollout_logprob", "ref_logprob", "token_loss"):
            t = getattr(batch, name)
            if t is not None and t.shape != shape:
                raise ValueError(
                    f"GuardBatch.{name} {tuple(t.shape)} does not match loss_mask {tuple(shape)}"
                )
        logp = batch.logprob.detach().float()
        old = batch.old_logprob.detach().float()
        adv = batch.advantages.detach().float()
        finite = torch.isfinite(logp) & torch.isfinite(old) & torch.isfinite(adv)
        log_ratio = torch.where(mask, logp - old, 0.0)
        nan = torch.full_like(logp, float("nan"))
        rollout = nan if batch.rollout_logprob is None else batch.rollout_logprob.detach().float()
        ref = nan if batch.ref_logprob is None else batch.ref_logprob.detach().float()
        if batch.rollout_logprob is not None:
            finite &= torch.isfinite(rollout)
        if batch.ref_logprob is not None:
            finite &= torch.isfinite(ref)
        bad = mask & ~finite
        good = mask & finite
        if batch.token_loss is not None:
            contribution = torch.where(mask, batch.token_loss.detach().float().abs(), 0.0)
        else:
            contribution = torch.where(
                mask, adv.abs() * torch.exp(log_ratio.clamp(-_EXP_CLAMP, _EXP_CLAMP)), 0.0
            )
        scores = {
            "abs_log_ratio": log_ratio.abs(),
            "loss_contribution": contribution,
            "rollout_abs_log_ratio": torch.where(mask, (old - rollout).abs(), 0.0),
            "abs_kl": torch.where(mask, (logp - ref).abs(), 0.0),
        }
        if batch.rollout_logprob is None:
            scores.pop("rollout_abs_log_ratio")
        if batch.ref_logprob is None:
            scores.pop("abs_kl")

        lim = self.limits
        zero = logp.new_zeros(())
        max_ratio = torch.where(good, log_ratio, -math.inf).max() if good.numel() else zero - math.inf

        def good_max(name):
            return torch.where(good, scores[name], 0.0).max() if name in scores and good.numel() else zero

        def over(name, limit):
            return ((scores[name] > limit) & good).sum() if name in scores and limit is not None else zero

        masked = ~mask if batch.response_mask is None else batch.response_mask.bool() & ~mask
        self._stats.append(
            torch.stack(
                [
                    good_max("abs_log_ratio"),
                    max_ratio,
                    good_max("rollout_abs_log_ratio"),
                    good_max("abs_kl"),
                    bad.sum().float(),
                    mask.sum().float(),
                    masked.sum().float(),
                    over("abs_log_ratio", lim.max_abs_log_ratio),
                    over("rollout_abs_log_ratio", lim.max_rollout_abs_log_ratio),
                    over("abs_kl", lim.max_abs_kl),
                ]
            ).double()
        )

        # Candidates: the top-k of every ranking (non-finite tokens first), so that the global
        # top-k over all micro-batches is exact. Masked tokens are never candidates.
        k = min(self.top_k, mask.numel())
        picks = []
        for score in scores.values():
            ranked = torch.where(bad, math.inf, torch.where(mask, score, -1.0))
            picks.append(torch.topk(ranked.flatten(), k).indices)
        index = torch.cat(picks).unique()
        num_cols = shape[1]
        cols = torch.arange(num_cols, device=mask.device).expand(shape)
        columns = {
            "logprob": logp,
            "old_logprob": old,
            "rollout_logprob": rollout,
            "ref_logprob": ref,
            "advantage": adv,
            "loss_mask": mask.float(),
            "log_ratio": logp - old,
            "loss_contribution": contribution,
            "token_id": nan if batch.token_ids is None else batch.token_ids,
            "turn": nan if batch.turn_index is None else batch.turn_index,
            "position": cols if batch.positions is None else batch.positions,
        }
        values = torch.stack([columns[f].double().flatten()[index] for f in _FIELDS])
        score_values = torch.stack([s.double().flatten()[index] for s in scores.values()])
        sample_ids = batch.sample_ids
        if sample_ids is not None:  # tensors / numpy arrays -> JSON-friendly python values
            sample_ids = [v.item() if hasattr(v, "item") else v for v in sample_ids]
        meta = {
            "micro_batch": len(self._candidates),
            "num_cols": num_cols,
            "given": {
                "rollout_logprob": batch.rollout_logprob is not None,
                "ref_logprob": batch.ref_logprob is not None,
            },
            "sample_ids": sample_ids,
            "token_source": batch.token_source,
            "decode": batch.decode,
            "score_names": list(scores),
        }
        self._candidates.append(
            (meta, index, values, score_values.masked_fill(bad.flatten()[index][None], math.inf))
        )

    # ---- per optimizer step ----------------------------------------------------------------
    def check(
        self,
        step: int,
        *,
        loss: torch.Tensor | float | Iterable | None = None,
        parameters: Iterable[torch.nn.Parameter] | None = None,
        grads: Iterable[torch.Tensor] | None = None,
        grad_norm: torch.Tensor | float | None = None,
    ) -> GuardDecision:
        """Decide whether optimizer step `step` must be skipped; same answer on all ranks.

        `loss`: the step's loss, or the list of micro-batch losses. `parameters`: whose `.grad`
        are checked for non-finite values (the local total norm). `grads`: gradient tensors to
        check the same way where they do not live in `.grad` (Megatron DDP: `p.main_grad`).
        `grad_norm`: an already computed total gradient norm (checked for finiteness and
        `max_grad_norm`).
        Raises `GuardError` when this is breach number `max_consecutive_skips + 1` in a row.
        """
        if not self.enabled:
            return GuardDecision(skip=False, reasons=[], report_path=None, metrics={"guard/skipped": 0.0})
        group = self.group if self.group is not None else _default_group()
        lim = self.limits
        flags = dict.fromkeys(_REASONS, False)

        losses = (
            [] if loss is None else [loss] if isinstance(loss, (torch.Tensor, float, int)) else list(loss)
        )
        flags["nonfinite_loss"] = any(not bool(torch.isfinite(torch.as_tensor(x)).all()) for x in losses)

        norms = []
        tensors = [] if grads is None else [g for g in grads if g is not None]
        if parameters is not None:
            tensors += [p.grad for p in parameters if p.grad is not None]
        if tensors:
            norms.append(float(torch.nn.utils.get_total_norm(tensors)))
        if grad_norm is not None:
            norms.append(float(grad_norm))
        flags["nonfinite_grad"] = any(not math.isfinite(n) for n in norms)
        finite_norms = [n for n in norms if math.isfinite(n)]
        if lim.max_grad_norm is not None:
            flags["grad_norm"] = any(n > lim.max_grad_norm for n in finite_norms)

        if self._stats:
            s = torch.stack(self._stats).cpu()
            maxima = s[:, :4].max(dim=0).values
            sums = s[:, 4:].sum(dim=0)
        else:
            maxima = torch.tensor([0.0, -math.inf, 0.0, 0.0], dtype=torch.float64)
            sums = torch.zeros(6, dtype=torch.float64)
        flags["nonfinite_tokens"] = bool(sums[0] > 0)
        flags["abs_log_ratio"] = lim.max_abs_log_ratio is not None and bool(maxima[0] > lim.max_abs_log_ratio)
        flags["ratio"] = lim.max_ratio is not None and bool(maxima[1] > math.log(lim.max_ratio))
        flags["rollout_abs_log_ratio"] = lim.max_rollout_abs_log_ratio is not None and bool(
            maxima[2] > lim.max_rollout_abs_log_ratio
        )
        flags["abs_kl"] = lim.max_abs_kl is not None and bool(maxima[3] > lim.max_abs_kl)

        local = torch.tensor([float(flags[r]) for r in _REASONS] + maxima.tolist(), dtype=torch.float64)
        glob = _all_reduce(local, dist.ReduceOp.MAX, group)
        sums = _all_reduce(sums.clone(), dist.ReduceOp.SUM, group)
        reasons = [r for r, v in zip(_REASONS, glob[: len(_REASONS)].tolist()) if v > 0]
        skip = bool(reasons)
        g_max = glob[len(_REASONS) :].tolist()

        self.consecutive_skips = self.consecutive_skips + 1 if skip else 0
        self.skipped_steps += int(skip)
        metrics = {
            "guard/skipped": float(skip),
            "guard/skipped_steps": float(self.skipped_steps),
            "guard/consecutive_skips": float(self.consecutive_skips),
            "guard/max_abs_log_ratio": g_max[0],
            "guard/max_rollout_abs_log_ratio": g_max[2],
            "guard/max_abs_kl": g_max[3],
            "guard/num_nonfinite_tokens": float(sums[0]),
            "guard/num_loss_tokens": float(sums[1]),
            "guard/num_masked_tokens": float(sums[2]),
        }
        report_path = None
        if skip:
            report_path = self._report(step, reasons, metrics, sums, finite_norms or norms, group)
        self._reset()
        decision = GuardDecision(skip=skip, reasons=reasons, report_path=report_path, metrics=metrics)
        if skip and self.consecutive_skips > self.max_consecutive_skips:
            raise GuardError(
                f"the step guard breached {self.consecutive_skips} optimizer steps in a row (step {step}; "
                f"reasons: {', '.join(reasons)}); more than max_consecutive_skips="
                f"{self.max_consecutive_skips}, stopping instead of training on garbage. "
                f"See the culprit report {report_path or self.run_dir / 'guard'}"
            )
        return decision

    # ---- reporting ---------------------------------------------------------------------------
    def _records(self) -> list[dict]:
        """Candidate tokens of this rank as plain dicts (one device-to-host copy per micro-batch)."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        records = []
        for meta, index, values, score_values in self._candidates:
            index, values, score_values = (
                index.cpu().tolist(),
                values.cpu().tolist(),
                score_values.cpu().tolist(),
            )
            for j, flat in enumerate(index):
                row, col = divmod(flat, meta["num_cols"])
                rec = {f: values[i][j] for i, f in enumerate(_FIELDS)}
                if not rec["loss_mask"]:
                    continue  # fewer loss tokens than top_k: topk also returned masked ones
                for name, given in meta["given"].items():
                    if not given:
                        rec[name] = None
                token_id = None if math.isnan(rec["token_id"]) else int(rec["token_id"])
                rec.update(
                    rank=rank,
                    micro_batch=meta["micro_batch"],
                    row=row,
                    sample_id=None if meta["sample_ids"] is None else meta["sample_ids"][row],
                    token_id=token_id,
                    turn=None if math.isnan(rec["turn"]) else int(rec["turn"]),
                    position=int(rec["position"]),
                    loss_mask=bool(rec["loss_mask"]),
                    source=None if meta["token_source"] is None else meta["token_source"][row][col],
                    text=None if meta["decode"] is None or token_id is None else meta["decode"](token_id),
                    scores=dict(zip(meta["score_names"], (s[j] for s in score_values))),
                )
                records.append(rec)
        return records

    def _breaches(self, rec: dict) -> list[str]:
        lim, s = self.limits, rec["scores"]
        out = []
        if any(math.isinf(v) for v in s.values()):
            out.append("nonfinite_tokens")
        for name, limit in (
            ("abs_log_ratio", lim.max_abs_log_ratio),
            ("rollout_abs_log_ratio", lim.max_rollout_abs_log_ratio),
            ("abs_kl", lim.max_abs_kl),
        ):
            if limit is not None and name in s and math.isfinite(s[name]) and s[name] > limit:
                out.append(name)
        if (
            lim.max_ratio is not None
            and math.isfinite(rec["log_ratio"])
            and rec["log_ratio"] > math.log(lim.max_ratio)
        ):
            out.append("ratio")
        return out

    def _report(self, step, reasons, metrics, sums, norms, group) -> Path | None:
        records = self._records()
        if group is not None and dist.get_world_size(group) > 1:
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, records, group=group)
            if dist.get_rank(group) != 0:
                return None
            records = [r for part in gathered for r in part]
        unique: dict = {}
        for rec in records:
            key = (rec["sample_id"], rec["turn"], rec["position"])
            if rec["sample_id"] is None:
                key = (rec["rank"], rec["micro_batch"], rec["row"], rec["position"])
            unique.setdefault(key, rec)
        records = list(unique.values())
        for rec in records:
            rec["breaches"] = self._breaches(rec)

        def clean(rec):
            out = {k: (_float(v) if isinstance(v, float) else v) for k, v in rec.items() if k != "scores"}
            out["scores"] = {k: _float(v) for k, v in rec["scores"].items()}
            return out

        report = {
            "step": step,
            "reasons": reasons,
            "limits": asdict(self.limits),
            "metrics": {k: _float(v) for k, v in metrics.items()},
            "grad_norms": [_float(n) for n in norms],
            "num_breaching_tokens": {
                "abs_log_ratio": int(sums[3]),
                "rollout_abs_log_ratio": int(sums[4]),
                "abs_kl": int(sums[5]),
                "nonfinite_tokens": int(sums[0]),
            },
            "breaching_tokens": [
                clean(r)
                for r in sorted(records, key=lambda r: -r["scores"]["abs_log_ratio"])
                if r["breaches"]
            ],
        }
        for key, score in _RANKINGS:
            ranked = [r for r in records if score in r["scores"]]
            ranked.sort(key=lambda r, s=score: -r["scores"][s])
            if ranked:
                report[key] = [clean(r) for r in ranked[: self.top_k]]
        path = self.run_dir / "guard" / f"step_{step:06d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(path)
        if self.console:
            print(format_report_table(report), flush=True)
        return path

    # ---- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Skip counters, for checkpoints."""
        return {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters of `state_dict`."""
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skips = int(state["consecutive_skips"])


def format_report_table(report: dict, key: str = "top_by_abs_log_ratio") -> str:
    """A short console table of one ranking of a guard report."""

    def num(v):
        return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))

    head = f"[guard] step {report['step']} skipped: {', '.join(report['reasons'])}"
    cols = (
        "sample",
        "turn",
        "pos",
        "token",
        "text",
        "source",
        "rollout",
        "old",
        "new",
        "ref",
        "adv",
        "mask",
        "logr",
    )
    rows = [cols]
    for r in report.get(key, []):
        text = None if r["text"] is None else repr(r["text"])[:16]
        rows.append(
            tuple(
                num(v)
                for v in (
                    r["sample_id"],
                    r["turn"],
                    r["position"],
                    r["token_id"],
                    text,
                    r["source"],
                    r["rollout_logprob"],
                    r["old_logprob"],
                    r["logprob"],
                    r["ref_logprob"],
                    r["advantage"],
                    int(r["loss_mask"]),
                    r["log_ratio"],
                )
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [head, f"  {key}:"] + ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
