"""What a user sees of a run: metrics.jsonl, the console table, TensorBoard, wandb, the PNG plot.

`RunLogger` is used by the driver process only, once per step:

    log = RunLogger(run_dir, cfg.logging, config_dict=config_to_dict(cfg))
    log.log(step, metrics)        # metrics: {"critic/score/mean": 0.4, "actor/entropy": 1.2, ...}
    log.close()

Every step appends one JSON line `{"step": N, **metrics}` to `<run_dir>/metrics.jsonl`, prints one
row of the console table (a header every `header_every` rows), and, where configured, writes
TensorBoard scalars (`<run_dir>/tensorboard`), logs to wandb and redraws `<run_dir>/metrics.png`
(on a background thread; `flush()` and `close()` wait for it). Non-finite values never stop the
logger: they are kept as float NaN / inf in `history`, written to metrics.jsonl as the JSON
strings "nan", "inf" and "-inf" (so the file stays strict JSON that any reader accepts, and NaN
stays distinguishable from inf), passed to TensorBoard and wandb as floats, and shown as `nan` /
`inf` in the table. `read_metrics` reads a metrics.jsonl back into floats.

`progress(desc, total, enabled)` is a tqdm bar on stderr while stderr is a terminal, else a no-op.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from megatron_agent.config import LoggingConfig

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
TENSORBOARD_DIR = "tensorboard"

# The console table: (header, width, format, metric names tried in order). The first name found in
# a row fills the cell; none found leaves it blank (e.g. val_acc on steps without validation).
TABLE_COLUMNS: tuple[tuple[str, int, str, tuple[str, ...]], ...] = (
    ("step", 6, "d", ("step",)),
    ("loss", 8, ".4f", ("actor/pg_loss", "sft/loss")),
    ("reward", 7, ".3f", ("critic/score/mean",)),
    ("val_acc", 7, ".3f", ("val/accuracy",)),
    ("kl", 9, ".2e", ("actor/kl_loss", "critic/kl")),
    ("entropy", 7, ".3f", ("actor/entropy",)),
    ("resp_len", 8, ".1f", ("response_length/mean",)),
    ("turns", 5, ".2f", ("num_turns/mean", "turns/mean")),
    ("tools", 6, ".0f", ("tool/calls",)),
    ("errs", 5, ".0f", ("tool/errors",)),
    ("mismatch", 9, ".2e", ("mismatch/mean_abs_diff",)),
    ("step_s", 7, ".1f", ("timing_s/step",)),
)
"""loss: the policy loss (RL) or the NLL (SFT steps); kl: KL to the reference (as a loss, else the
mean log-ratio old - ref); mismatch: mean |old - rollout| log-prob over loss tokens."""


def to_json_value(value: float) -> float | str:
    """A float as metrics.jsonl stores it: itself when finite, else "nan", "inf" or "-inf"."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _to_float(key: str, value: Any) -> float:
    """A metric value (float, int, bool, numpy or 0-d torch scalar, or "nan"/"inf" text) as float."""
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "+inf", "infinity"):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"metric {key!r} has value {value!r} of type {type(value).__name__}; log one number per "
            f"name (call .item() on a tensor, log a list element by element under its own name)"
        ) from None


def _clean_row(step: Any, metrics: Mapping[str, Any]) -> dict[str, float]:
    """{"step": int, **float metrics}; errors name a bad step, key or value.

    A "step" key in `metrics` is accepted when it equals `step`.
    """
    try:
        row: dict[str, Any] = {"step": operator.index(step)}
    except TypeError:
        raise ValueError(f"step must be an integer, got {step!r} of type {type(step).__name__}") from None
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric names must be non-empty strings, got {key!r}")
        if key == "step":
            if value != row["step"]:
                raise ValueError(
                    f"metrics hold 'step': {value!r} but the row is logged as step {row['step']}"
                )
            continue
        row[key] = _to_float(key, value)
    return row


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of a metrics.jsonl as dicts of floats ("nan"/"inf" strings become floats)."""
    rows = []
    with open(path) as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{num}: not a JSON line ({e}); was the file cut by a crash?"
                ) from None
            rows.append(_clean_row(raw.pop("step"), raw))
    return rows


def format_header() -> str:
    """The console table's header line."""
    return "  ".join(f"{name:>{width}}" for name, width, _, _ in TABLE_COLUMNS)


def format_row(row: Mapping[str, float]) -> str:
    """One console table line for a row of metrics (blank cells for missing metrics)."""
    cells = []
    for _, width, fmt, keys in TABLE_COLUMNS:
        key = next((k for k in keys if k in row), None)
        if key is None:
            text = ""
        elif not math.isfinite(row[key]):
            text = str(to_json_value(row[key]))
        elif fmt == "d":
            text = str(int(row[key]))
        else:
            text = format(row[key], fmt)
        cells.append(f"{text:>{width}}")
    return "  ".join(cells).rstrip()


class RunLogger:
    """Per-step metrics of a run to metrics.jsonl, the console, TensorBoard, wandb and a PNG.

    `run_dir`: the run folder (created). `cfg`: which outputs besides metrics.jsonl and the table.
    `config_dict`: the run's config, stored as wandb config and as TensorBoard text.
    `stream`: where the table goes (stdout). `header_every`: table rows between headers.
    Steps must increase; `history` holds every row logged (or restored by `load_history`).
    """

    def __init__(
        self,
        run_dir: str | Path,
        cfg: LoggingConfig | None = None,
        config_dict: Mapping[str, Any] | None = None,
        stream: TextIO | None = None,
        header_every: int = 20,
    ):
        self.run_dir = Path(run_dir)
        self.cfg = cfg if cfg is not None else LoggingConfig()
        self.config_dict = dict(config_dict or {})
        self.stream = stream if stream is not None else sys.stdout
        self.header_every = header_every
        self.history: list[dict[str, float]] = []
        self.metrics_path = self.run_dir / METRICS_FILE
        self.plot_path = self.run_dir / PLOT_FILE
        self._file: TextIO | None = None
        self._tb = None
        self._tb_purge_step: int | None = None
        self._wandb_run = None
        self._rows_since_header = 0
        self._closed = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Fail at start, not at step 1, when an enabled output lacks its package.
        self._plotter = None
        if self.cfg.plot:
            _require("matplotlib", "matplotlib==3.11.2", "logging.plot=false")
            from megatron_agent.train.plot import BackgroundPlotter

            self._plotter = BackgroundPlotter(self.plot_path, title=self.run_dir.name)
        if self.cfg.tensorboard:
            _require("tensorboard", "tensorboard==2.21.0", "logging.tensorboard=false")
        if self.cfg.wandb_project:
            self._wandb_run = _start_wandb(self.cfg.wandb_project, self.run_dir, self.config_dict)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Record one step's metrics everywhere configured; returns the stored row."""
        if self._closed:
            raise RuntimeError(f"RunLogger for {self.run_dir} is closed; create a new one to log more")
        row = _clean_row(step, metrics)
        if self.history and row["step"] <= self.history[-1]["step"]:
            raise ValueError(
                f"step {row['step']} logged after step {self.history[-1]['step']}: log each step once, "
                f"in increasing order (merge a step's metrics into one dict; after a resume call "
                f"load_history with the checkpoint's rows)"
            )
        self.history.append(row)
        self._jsonl().write(json.dumps({k: to_json_value(v) for k, v in row.items()}) + "\n")
        self._file.flush()
        self._print_row(row)
        if self.cfg.tensorboard:
            self._tensorboard_log(row)
        if self._wandb_run is not None:
            # Charts use our "step" (see _start_wandb); wandb's own _step just counts rows.
            self._wandb_run.log(row)
        if self._plotter is not None:
            self._plotter.submit(list(self.history))
        return row

    def load_history(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Restore the rows of a resumed run (e.g. from a checkpoint) before logging further steps.

        metrics.jsonl is rewritten to hold exactly these rows (lines of steps after the checkpoint,
        which the resumed run repeats, are dropped: no duplicates); TensorBoard hides its events
        from the next step on; the plot is redrawn.
        """
        restored = []
        for raw in rows:
            raw = dict(raw)
            if "step" not in raw:
                raise ValueError(f"history row without a 'step': {raw!r}")
            restored.append(_clean_row(raw.pop("step"), raw))
        steps = [r["step"] for r in restored]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"history steps must increase, got {steps}")
        if self._file is not None:
            self._file.close()
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for r in restored:
                f.write(json.dumps({k: to_json_value(v) for k, v in r.items()}) + "\n")
        os.replace(tmp, self.metrics_path)
        self._file = open(self.metrics_path, "a")
        self.history = restored
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._tb_purge_step = restored[-1]["step"] + 1 if restored else None
        if self._plotter is not None and restored:
            self._plotter.submit(list(self.history))

    def flush(self) -> None:
        """Wait until metrics.png shows the last step (it is redrawn on a background thread)."""
        if self._plotter is not None:
            self._plotter.wait()

    def close(self) -> None:
        """Flush and close every output (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.finish()
            # finish() can return before wandb's service has written the run file; teardown waits.
            wandb.teardown()
        if self._plotter is not None:
            self._plotter.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _jsonl(self) -> TextIO:
        """metrics.jsonl opened for appending; an old run's file is moved aside first."""
        if self._file is None:
            if self.metrics_path.exists() and self.metrics_path.stat().st_size > 0:
                num = 1
                while (aside := self.run_dir / f"metrics.prev{num}.jsonl").exists():
                    num += 1
                os.replace(self.metrics_path, aside)
                warnings.warn(
                    f"{self.metrics_path} held rows of an earlier run and no history was restored; "
                    f"moved it to {aside.name}. To continue a run, call load_history(rows) first.",
                    stacklevel=3,
                )
            self._file = open(self.metrics_path, "a")
        return self._file

    def _print_row(self, row: Mapping[str, float]) -> None:
        if self._rows_since_header == 0:
            print(f"run {self.run_dir}: metrics in {self.metrics_path.name}", file=self.stream)
        if self._rows_since_header % self.header_every == 0:
            print(format_header(), file=self.stream)
        self._rows_since_header += 1
        print(format_row(row), file=self.stream, flush=True)

    def _tensorboard_log(self, row: Mapping[str, float]) -> None:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a crashed run wrote after the step it resumes from.
            self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=self._tb_purge_step)
            if self.config_dict and self._tb_purge_step is None:
                text = json.dumps(self.config_dict, indent=2, default=str)
                self._tb.add_text("config", "```\n" + text + "\n```", 0)
        for key, value in row.items():
            if key != "step":
                self._tb.add_scalar(key, value, row["step"])
        self._tb.flush()


def _require(module: str, pip_name: str, off_switch: str) -> None:
    """Import `module` or raise an ImportError naming the pip package and the option to turn off."""
    try:
        __import__(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is needed by this logging option but is not installed ({e}); "
            f"install it with `pip install {pip_name}` or set {off_switch}"
        ) from e


def _start_wandb(project: str, run_dir: Path, config: Mapping[str, Any]):
    """A wandb run writing under run_dir (WANDB_MODE=offline works without a network)."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            f"logging.wandb_project={project!r} needs wandb, which is not installed; "
            f"install it with `pip install wandb` or set logging.wandb_project=''"
        ) from e
    # console="off": wandb would otherwise wrap stdout, where the table is printed.
    run = wandb.init(
        project=project,
        name=run_dir.name,
        dir=str(run_dir),
        config=dict(config),
        settings=wandb.Settings(console="off"),
    )
    # wandb drops rows whose own step is negative (SFT steps are logged as -N..-1) or not above the
    # last one; plotting every metric over our "step" avoids both.
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


class _NoBar:
    """The no-op stand-in for a tqdm bar (not a terminal, or bars turned off)."""

    def update(self, n: float = 1) -> None:
        """Ignore progress."""

    def set_postfix(self, *args, **kwargs) -> None:
        """Ignore a status text."""


@contextlib.contextmanager
def progress(
    desc: str,
    total: float | None = None,
    enabled: bool = True,
    stream: TextIO | None = None,
    unit: str = "it",
) -> Iterator[Any]:
    """A tqdm progress bar on `stream` (stderr) when enabled and it is a terminal, else a no-op.

    Yields an object with `update(n)` and `set_postfix(...)`. The bar is removed when the block
    ends (leave=False), so the per-step table stays clean.
    """
    stream = stream if stream is not None else sys.stderr
    if not enabled or not stream.isatty():
        yield _NoBar()
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, file=stream, leave=False, dynamic_ncols=True, unit=unit) as bar:
        yield bar
