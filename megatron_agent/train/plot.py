"""The run's PNG plot: reward and accuracy, KL, entropy, loss, response length, tool calls,
rollout-vs-trainer mismatch and step time, over steps.

Drawn headless (matplotlib's Agg canvas on a `Figure`, no pyplot state) and written atomically
(a temporary file renamed over the old PNG), so a viewer never reads half a file. `BackgroundPlotter`
redraws on a worker thread so that the training step does not wait for it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# (panel title, y-axis label, [(metric name, legend label), ...]); a panel shows the series present.
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "reward and accuracy",
        "",
        (
            ("critic/score/mean", "train reward"),
            ("val/score/mean", "val reward"),
            ("val/accuracy", "val accuracy"),
        ),
    ),
    (
        "KL",
        "nats per token",
        (
            ("actor/kl_loss", "to reference (loss)"),
            ("critic/kl", "to reference (mean old - ref)"),
            ("actor/ppo_kl", "PPO: old vs new"),
        ),
    ),
    ("entropy", "nats per token", (("actor/entropy", "entropy"),)),
    ("loss", "", (("actor/pg_loss", "policy loss"), ("sft/loss", "SFT loss (NLL)"))),
    (
        "response length",
        "tokens",
        (("response_length/mean", "mean"), ("response_length/max", "max")),
    ),
    ("tool calls", "per step", (("tool/calls", "calls"), ("tool/errors", "errors"))),
    (
        "rollout vs trainer log-prob",
        "|old - rollout|",
        (("mismatch/mean_abs_diff", "mean"), ("mismatch/max_abs_diff", "max")),
    ),
    (
        "time per step",
        "seconds",
        (("timing_s/step", "step"), ("timing_s/gen", "generation"), ("timing_s/update_actor", "update")),
    ),
)

VALUE_PANEL = (
    "value (critic)",
    "",
    (
        ("critic/vf_loss", "value loss"),
        ("critic/vf_explained_var", "explained variance"),
        ("critic/values/mean", "mean value"),
        ("critic/returns/mean", "mean return"),
    ),
)
"""Added when a critic runs (algorithm.adv_estimator=gae)."""

LOG_SCALE_PANELS = ("rollout vs trainer log-prob",)
"""Panels drawn on a log y-axis when all their values are positive (they span decades)."""

_MARKER_MAX_POINTS = 40
"""Series with at most this many points get markers (sparse ones such as val/* stay visible)."""


def plot_metrics(rows: Sequence[Mapping[str, float]], path: str | Path, title: str = "") -> Path:
    """Draw the metrics of `rows` (each with "step") over steps into the PNG at `path`.

    Non-finite values leave a gap in their line and a red dotted vertical line at their step.
    Returns `path`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    panels = PANELS + ((VALUE_PANEL,) if any("critic/vf_loss" in r for r in rows) else ())
    columns = math.ceil(len(panels) / 2)
    # Fixed margins: constrained layout would double the drawing time.
    fig = Figure(figsize=(4.5 * columns, 8), dpi=100)
    fig.subplots_adjust(left=0.045, right=0.99, bottom=0.07, top=0.9, wspace=0.2, hspace=0.22)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, columns, sharex=True).ravel()
    last_step = rows[-1]["step"] if rows else None
    heading = f"{title}  (step {last_step})" if title else f"step {last_step}"
    sft_rows = [r for r in rows if r["step"] < 0]
    if sft_rows and len(sft_rows) < len(rows):
        # Once RL runs, its steps get the whole x axis; the SFT phase is summarised in the title.
        final = sft_rows[-1].get("sft/loss", math.nan)
        heading += f"    (after {len(sft_rows)} SFT steps, final SFT loss {final:.3g})"
        rows = rows[len(sft_rows) :]
    first_step = rows[0]["step"] if rows else 0
    if first_step < 0:
        heading += "    shaded: SFT steps (logged as -N..-1)"
    fig.suptitle(heading, fontsize=13)
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax, (panel_title, ylabel, series) in zip(axes, panels):
        _draw_panel(ax, rows, panel_title, ylabel, series)
        if first_step < 0:
            ax.axvspan(first_step - 0.5, -0.5, color="gray", alpha=0.12, linewidth=0)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)  # an odd number of panels leaves one cell empty
    for ax in axes[columns:]:
        ax.set_xlabel("step")
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _draw_panel(ax, rows, panel_title: str, ylabel: str, series) -> None:
    ax.set_title(panel_title, fontsize=11)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    bad_steps: set[int] = set()
    drawn, positive = 0, True
    for key, label in series:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            continue
        steps = [s for s, _ in points]
        values = [v if math.isfinite(v) else math.nan for _, v in points]
        bad_steps.update(s for s, v in points if not math.isfinite(v))
        positive = positive and all(v > 0 for v in values if not math.isnan(v))
        marker = "o" if len(points) <= _MARKER_MAX_POINTS else None
        last = next((v for v in reversed(values) if not math.isnan(v)), math.nan)
        ax.plot(steps, values, marker=marker, markersize=3.5, linewidth=1.6, label=f"{label} ({last:.3g})")
        drawn += 1
    for step in sorted(bad_steps):
        ax.axvline(step, color="red", linestyle=":", linewidth=1.2)
    if bad_steps:
        ax.plot([], [], color="red", linestyle=":", label="non-finite value")
    if drawn == 0:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    if panel_title in LOG_SCALE_PANELS and positive:
        ax.set_yscale("log")
    ax.legend(fontsize=8, loc="best", framealpha=0.8)


class BackgroundPlotter:
    """Redraws a PNG on one worker thread so that a step does not wait for matplotlib.

    `submit(rows)` asks for a redraw of `rows` (a snapshot: the list must not change later); when
    several requests arrive before a redraw starts only the latest is drawn. A redraw takes about
    0.5 s of a core at the quickstart's size, and a step of a small run is shorter than that:
    redrawn after every step, the plot kept a core busy and the workers' threads then waited for
    it (the quickstart's SFT steps took 0.59 s instead of 0.19 s on 2 cores). So after a redraw
    of d seconds the next one starts no sooner than d x (1 / `max_share` - 1) later: the thread
    spends at most `max_share` of a core (by default 5%: a 0.5 s redraw every 10 s). `wait()`
    draws the last request at once and blocks until it is on disk. An error in a redraw is
    raised by the next `submit` or `wait`.
    """

    def __init__(self, path: str | Path, title: str = "", max_share: float = 0.05):
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        self.path = Path(path)
        self.title = title
        self.max_share = max_share
        self.num_redraws = 0  # redraws done (the throttle's effect is visible in tests)
        self._cond = threading.Condition()
        self._pending: Sequence[Mapping[str, float]] | None = None
        self._busy = False
        self._flush = False  # wait() asked for the pending request now
        self._next_at = 0.0  # time.monotonic() before which no redraw starts unless flushed
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="metrics-plot", daemon=True)
        self._thread.start()

    def submit(self, rows: Sequence[Mapping[str, float]]) -> None:
        """Ask for a redraw of `rows` (returns at once)."""
        with self._cond:
            self._raise_error()
            self._pending = rows
            self._cond.notify_all()

    def wait(self) -> None:
        """Draw the last request now (not at its throttled time) and block until it is on disk."""
        with self._cond:
            self._flush = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._pending is None and not self._busy)
            self._flush = False
            self._raise_error()

    def close(self) -> None:
        """Finish the last redraw, then stop the thread."""
        try:
            self.wait()
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"redrawing {self.path} failed: {error!r}") from error

    def _due(self) -> bool:
        """Whether the pending request may be drawn now (called with the lock held)."""
        return self._pending is not None and (self._flush or self._stop or time.monotonic() >= self._next_at)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._due():
                    if self._stop and self._pending is None:
                        return
                    timeout = self._next_at - time.monotonic() if self._pending is not None else None
                    self._cond.wait(timeout)
                rows, self._pending, self._busy = self._pending, None, True
            start = time.monotonic()
            try:
                plot_metrics(rows, self.path, self.title)
            except BaseException as e:  # handed to the caller's thread
                with self._cond:
                    self._error = e
            finally:
                took = time.monotonic() - start
                with self._cond:
                    self.num_redraws += 1
                    self._next_at = time.monotonic() + took * (1 / self.max_share - 1)
                    self._busy = False
                    self._cond.notify_all()
