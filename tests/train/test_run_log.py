"""RunLogger: metrics.jsonl, the console table, the PNG, TensorBoard, wandb (offline), resume, bars."""

from __future__ import annotations

import fcntl
import io
import json
import math
import os
import struct
import sys
import termios
import time

import pytest

from megatron_agent.config import LoggingConfig
from megatron_agent.train.run_log import TABLE_COLUMNS, RunLogger, progress, read_metrics

NAN, INF = float("nan"), float("inf")


def _step_metrics(step: int) -> dict[str, float]:
    """Plausible metrics of one RL step (val/* only every 5 steps, as on validation steps)."""
    m = {
        "actor/pg_loss": -0.0125,
        "critic/score/mean": 0.25 + 0.02 * step,
        "actor/kl_loss": 1e-3 * step,
        "actor/ppo_kl": 1e-4,
        "actor/entropy": 1.5 - 0.03 * step,
        "response_length/mean": 80.0 + 3 * step,
        "response_length/max": 150.0 + 2 * step,
        "num_turns/mean": 1.5,
        "tool/calls": 20.0 + step,
        "tool/errors": float(max(0, 5 - step)),
        "mismatch/mean_abs_diff": 2e-5,
        "timing_s/step": 4.25,
    }
    if step % 5 == 0:
        m["val/accuracy"] = 0.3 + 0.01 * step
    return m


def _cells(line: str) -> dict[str, str]:
    """Split a table line into its columns by the widths of TABLE_COLUMNS."""
    cells, pos = {}, 0
    for name, width, _, _ in TABLE_COLUMNS:
        cells[name] = line[pos : pos + width].strip()
        pos += width + 2
    return cells


def _strict_json(line: str) -> dict:
    def reject(const):
        raise AssertionError(f"non-standard JSON constant {const} in {line!r}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_rows_and_table_with_nan_and_missing_val(tmp_path):
    out = io.StringIO()
    log = RunLogger(tmp_path, LoggingConfig(plot=False), stream=out)
    log.log(0, _step_metrics(0))
    log.log(1, {**_step_metrics(1), "actor/entropy": NAN, "actor/kl_loss": -INF})
    log.log(2, {**_step_metrics(2), "tool/calls": 7})
    log.close()

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    rows = [_strict_json(line) for line in lines]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["val/accuracy"] == pytest.approx(0.3) and "val/accuracy" not in rows[1]
    assert rows[1]["actor/entropy"] == "nan" and rows[1]["actor/kl_loss"] == "-inf"
    assert rows[2]["tool/calls"] == 7.0
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back[1]["actor/entropy"]) and back[1]["actor/kl_loss"] == -INF
    assert back[0] == log.history[0] and back[2] == log.history[2]

    text = out.getvalue().splitlines()
    assert text[0].startswith("run ") and text[1].split()[:4] == ["step", "loss", "reward", "val_acc"]
    table = [_cells(line) for line in text[2:]]
    assert len(table) == 3
    assert table[0] == {
        "step": "0",
        "loss": "-0.0125",
        "reward": "0.250",
        "val_acc": "0.300",
        "kl": "0.00e+00",
        "entropy": "1.500",
        "resp_len": "80.0",
        "turns": "1.50",
        "tools": "20",
        "errs": "5",
        "mismatch": "2.00e-05",
        "step_s": "4.2",
    }
    assert table[1]["val_acc"] == "" and table[1]["entropy"] == "nan" and table[1]["kl"] == "-inf"
    assert table[2]["tools"] == "7" and table[2]["reward"] == "0.290"


def test_header_repeats_and_bad_input_is_named(tmp_path):
    out = io.StringIO()
    log = RunLogger(tmp_path, LoggingConfig(plot=False), stream=out, header_every=2)
    for step in range(5):
        log.log(step, {"critic/score/mean": 0.5})
    assert sum(line.split()[:1] == ["step"] for line in out.getvalue().splitlines()) == 3
    with pytest.raises(ValueError, match="'actor/entropy'.*list"):
        log.log(5, {"actor/entropy": [1.0, 2.0]})
    with pytest.raises(ValueError, match="step 4 logged after step 4"):
        log.log(4, {"critic/score/mean": 0.5})
    with pytest.raises(ValueError, match="'step': 3 but the row is logged as step 6"):
        log.log(6, {"step": 3})
    log.log(6, {"step": 6, "critic/score/mean": 0.5})  # a "step" key equal to the step is fine
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 6]


def test_plot_is_a_real_png_with_the_last_step_once_flushed(tmp_path):
    import matplotlib.image

    log = RunLogger(tmp_path, LoggingConfig(plot=True), stream=io.StringIO())
    for step in range(20):
        log.log(step, {**_step_metrics(step), **({"actor/entropy": NAN} if step == 7 else {})})
    log.flush()
    png = tmp_path / "metrics.png"
    first = png.read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n" and len(first) > 30_000
    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (800, 1800)
    # Not a blank canvas: many distinct colours (lines, text, legends).
    assert len({tuple(p) for p in image[::5, ::5].reshape(-1, image.shape[2]).tolist()}) > 50
    log.log(20, _step_metrics(20))
    log.close()
    assert png.read_bytes() != first
    assert not list(tmp_path.glob("*.tmp"))


def test_the_plotter_keeps_to_its_share_of_a_core_and_a_flush_draws_the_last_rows(tmp_path, monkeypatch):
    import megatron_agent.train.plot as plot

    drawn = []

    def slow_plot(rows, path, title=""):
        time.sleep(0.05)  # a redraw of 0.05 s: at 2%, the next no sooner than 2.45 s later
        drawn.append((time.monotonic(), rows[-1]["step"]))

    monkeypatch.setattr(plot, "plot_metrics", slow_plot)
    plotter = plot.BackgroundPlotter(tmp_path / "m.png", max_share=0.02)
    for step in range(60):  # a step every 20 ms for 1.2 s: one redraw, at the first step
        plotter.submit([{"step": step}])
        time.sleep(0.02)
    assert len(drawn) == 1 and drawn[0][1] <= 5, drawn
    flushed_at = time.monotonic()
    plotter.wait()  # the last rows now, not 2.45 s after the first redraw
    assert len(drawn) == 2 and drawn[1][1] == 59 and drawn[1][0] - flushed_at < 1.0, drawn
    assert plotter.num_redraws == 2
    plotter.submit([{"step": 60}])
    plotter.close()  # closing draws what is pending, too
    assert [step for _, step in drawn][1:] == [59, 60]
    with pytest.raises(ValueError, match="max_share"):
        plot.BackgroundPlotter(tmp_path / "x.png", max_share=0)


def _tb_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    log = RunLogger(tmp_path, LoggingConfig(plot=False, tensorboard=True), config_dict={"a": 1})
    for step in range(3):
        log.log(step, {**_step_metrics(step), **({"actor/entropy": NAN} if step == 1 else {})})
    log.close()
    scalars = _tb_scalars(tmp_path / "tensorboard")
    assert set(_step_metrics(1)) <= set(scalars) and "val/accuracy" in scalars
    assert scalars["val/accuracy"] == [(0, pytest.approx(0.3))]
    assert [s for s, _ in scalars["tool/calls"]] == [0, 1, 2]
    assert [v for _, v in scalars["tool/calls"]] == pytest.approx([20.0, 21.0, 22.0])
    entropy = [v for _, v in scalars["actor/entropy"]]
    assert entropy[0] == pytest.approx(1.5) and math.isnan(entropy[1])


def test_history_reload_after_a_crash_has_no_duplicates(tmp_path):
    cfg = LoggingConfig(plot=True, tensorboard=True)
    first = RunLogger(tmp_path, cfg, stream=io.StringIO())
    for step in range(5):
        first.log(step, {"critic/score/mean": float(step)})
    checkpoint_rows = json.loads(json.dumps(first.history[:3]))  # the checkpoint was at step 2
    first.close()  # the run crashed after step 4
    (tmp_path / "metrics.png").unlink()

    resumed = RunLogger(tmp_path, cfg, stream=io.StringIO())
    resumed.load_history(checkpoint_rows)
    resumed.flush()
    assert (tmp_path / "metrics.png").stat().st_size > 10_000  # re-plotted from the history
    for step in (3, 4):
        resumed.log(step, {"critic/score/mean": 10.0 + step})
    resumed.close()

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["critic/score/mean"] for r in rows] == [0.0, 1.0, 2.0, 13.0, 14.0]
    assert resumed.history == rows
    # TensorBoard hides the crashed run's steps 3 and 4 (purge_step), keeping one value per step.
    assert _tb_scalars(tmp_path / "tensorboard")["critic/score/mean"] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
    ]


def test_fresh_run_moves_an_old_metrics_file_aside(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1.0}\n')
    log = RunLogger(tmp_path, LoggingConfig(plot=False), stream=io.StringIO())
    with pytest.warns(UserWarning, match="load_history"):
        log.log(0, {"x": 2.0})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "x": 2.0}]
    assert read_metrics(tmp_path / "metrics.prev1.jsonl") == [{"step": 0, "x": 1.0}]


def test_missing_optional_packages_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        RunLogger(tmp_path, LoggingConfig(plot=False, wandb_project="p"))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install tensorboard==.*logging.tensorboard=false"):
        RunLogger(tmp_path, LoggingConfig(plot=False, tensorboard=True))


def _wandb_history(run_dir) -> list[dict[str, str]]:
    """History records of the offline run file (a LevelDB-style log of wandb Record protobufs)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, chunk, history = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST piece of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                history.append({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
    return history


def test_wandb_offline_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLogger(tmp_path, LoggingConfig(plot=False, wandb_project="megatron-agent-test"), {"seed": 3})
    log.log(-1, {"sft/loss": 2.5})  # SFT steps are negative; wandb itself would drop them
    log.log(0, {"critic/score/mean": 0.5, "actor/entropy": NAN})
    log.log(1, {"critic/score/mean": 0.75, "val/accuracy": 0.25})
    log.close()  # returns once the run file is complete
    history = _wandb_history(tmp_path)
    assert [h["step"] for h in history] == ["-1", "0", "1"]
    assert float(history[0]["sft/loss"]) == 2.5
    assert float(history[1]["critic/score/mean"]) == 0.5 and history[1]["actor/entropy"] == "NaN"
    assert float(history[2]["val/accuracy"]) == 0.25


def test_progress_bar_only_on_a_terminal():
    not_tty = io.StringIO()
    with progress("rollout", total=4, stream=not_tty) as bar:
        bar.update(2)
        bar.set_postfix(reward=0.5)
    assert not_tty.getvalue() == ""

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    with open(slave, "w") as tty:
        with progress("rollout", total=4, enabled=False, stream=tty) as bar:
            bar.update(4)
        tty.flush()
        os.set_blocking(master, False)
        with pytest.raises(BlockingIOError):
            os.read(master, 4096)
        with progress("update", total=4, stream=tty) as bar:
            bar.update(3)
        tty.flush()
        written = os.read(master, 65536).decode()
    os.close(master)
    assert "update:" in written and "0/4" in written
