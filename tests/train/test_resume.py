"""Whole-run checkpoints, resume and stop signals, on the real stack (`python -m megatron_agent train`).

One uninterrupted reference run (4 steps, a checkpoint every step, keep_last=2, 4 tasks: an epoch
is 2 steps) is compared with a run stopped by SIGTERM during step 2 and resumed, and with a
resume from a copy of the reference whose newest checkpoint was altered (at TP2 instead of TP1).
The driver-side pieces (rotation, resume choice, signals) are also tested on their own.
"""

import json
import os
import shutil
import signal
import subprocess

import pytest

from megatron_agent.checkpoint.manifest import write_manifest
from megatron_agent.errors import InputError
from tests.conftest import REPO, quickstart_train_cmd, sigterm_after_step_1

TINY = [
    "sft.steps=0",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=1",
    "rollout.n=2",
    "rollout.max_new_tokens=24",
    "data.num_synthetic_tasks=4",
    "data.num_synthetic_val_tasks=2",
    "trainer.total_steps=4",
    "trainer.test_freq=0",
    "logging.plot=false",
    "actor.lr_decay=linear",  # a different learning rate at every step: the schedule must resume
]


def _cmd(run_dir, *overrides):
    return quickstart_train_cmd(run_dir, *TINY, *overrides)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1")


def _run(run_dir, *overrides, timeout=900):
    proc = subprocess.run(
        _cmd(run_dir, *overrides), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    return proc


def _ok(proc):
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _dump(run_dir, step):
    return (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()


def _task_uids(run_dir, step):
    return sorted(json.loads(line)["uid"].rsplit("/", 1)[0] for line in _dump(run_dir, step))


def _metric_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lrs(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["actor/lr"] for r in rows if r["step"] >= 1]


def _checkpoints(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module", autouse=True)
def task_file(tmp_path_factory):
    """4 arithmetic tasks and 2 bad rows (skipped and counted as data/skipped_rows)."""
    from megatron_agent.data.synthetic import arithmetic_tasks
    from megatron_agent.data.tasks import write_tasks

    path = write_tasks(tmp_path_factory.mktemp("tasks") / "train.jsonl", arithmetic_tasks(4, seed=3))
    with open(path, "a") as f:
        f.write('{"uid": "broken", "prompt": [], "reward": {}}\n{not json\n')
    TINY.append(f"data.train_path={path}")
    yield path
    TINY.remove(f"data.train_path={path}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume") / "reference"
    proc = _ok(_run(run_dir, "checkpoint.save_freq=1", "checkpoint.keep_last=2"))
    return run_dir, proc


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    """A run stopped by SIGTERM as soon as step 1 is dumped (so during step 2), then resumed."""
    run_dir = tmp_path_factory.mktemp("resume") / "signalled"
    stopped = _ok(sigterm_after_step_1(_cmd(run_dir), run_dir, _env()))
    saved = _checkpoints(run_dir)
    resumed = _ok(_run(run_dir))
    return run_dir, stopped, saved, resumed


def test_keep_last_keeps_the_newest_complete_checkpoints(reference):
    run_dir, proc = reference
    assert _checkpoints(run_dir) == ["step_000003", "step_000004"]
    ckpt = run_dir / "checkpoints" / "step_000004"
    for part in ("model", "optim", "trainer/worker.pt", "trainer/rng_rank00000.pt", "manifest.json"):
        assert (ckpt / part).exists(), part
    driver = json.loads((ckpt / "trainer" / "driver.json").read_text())
    assert driver["step"] == 4 and driver["sampler"] == {**driver["sampler"], "epoch": 2, "position": 0}
    assert [r["step"] for r in driver["history"]] == [0, 1, 2, 3, 4]
    assert driver["history"][0]["data/skipped_rows"] == 2.0  # the two bad rows of the task file


def test_finished_run_exits_0_without_training(reference):
    run_dir, _ = reference
    before = (run_dir / "metrics.jsonl").read_text()
    proc = _ok(_run(run_dir, "checkpoint.save_freq=1", "checkpoint.keep_last=2", timeout=300))
    assert "already finished" in proc.stdout and "step 4 of trainer.total_steps=4" in proc.stdout
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert _checkpoints(run_dir) == ["step_000003", "step_000004"]


def test_sigterm_saves_exits_0_and_resume_continues_with_the_same_prompts(reference, signalled):
    ref_dir, _ = reference
    run_dir, stopped, saved, resumed = signalled
    assert "SIGTERM received" in stopped.stderr
    stop_step = int(stopped.stdout.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert 1 <= stop_step < 4
    assert saved == [f"step_{stop_step:06d}"]  # save_freq=0: only the signal's save
    assert f"continuing at step {stop_step + 1}" in resumed.stdout
    assert _metric_steps(run_dir) == [0, 1, 2, 3, 4]  # no step lost or repeated
    assert _lrs(run_dir) == _lrs(ref_dir) and len(set(_lrs(ref_dir))) == 4
    for step in range(1, 5):  # step 3 opens the second epoch
        assert _task_uids(run_dir, step) == _task_uids(ref_dir, step), step
        versions = {json.loads(line)["weight_version"] for line in _dump(run_dir, step)}
        assert versions == {step}, (step, versions)
    driver = json.loads((run_dir / "checkpoints" / "step_000004" / "trainer" / "driver.json").read_text())
    assert driver["sampler"]["epoch"] == 2 and driver["sampler"]["position"] == 0


def test_altered_checkpoint_is_refused_and_the_previous_one_resumed_at_another_layout(reference, tmp_path):
    ref_dir, _ = reference
    run_dir = tmp_path / "copy"
    shutil.copytree(ref_dir, run_dir, ignore=shutil.ignore_patterns("logs"))
    bad = run_dir / "checkpoints" / "step_000004" / "optim" / "__0_0.distcp"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    proc = _ok(_run(run_dir, "parallel.tp=2", "checkpoint.keep_last=2"))
    assert f"checkpoint file altered: {bad}" in proc.stderr
    assert "resumed from" in proc.stdout and "step_000003 (step 3)" in proc.stdout
    assert _metric_steps(run_dir) == [0, 1, 2, 3, 4]
    assert _lrs(run_dir) == _lrs(ref_dir)
    assert _task_uids(run_dir, 4) == _task_uids(ref_dir, 4)
    # the altered checkpoint was moved aside, not written over: its bytes are all still there
    damaged, *steps = _checkpoints(run_dir)
    assert steps == ["step_000003", "step_000004"] and damaged.startswith("damaged-")
    kept = run_dir / "checkpoints" / damaged / "step_000004" / "optim" / "__0_0.distcp"
    assert kept.read_bytes() == bytes(data)


# ------------------------------------------------------------------------------- driver side only
def _fake_checkpoint(root, step, *, complete=True):
    from megatron_agent.train.run_state import step_dir

    path = step_dir(root, step)
    (path / "trainer").mkdir(parents=True)
    (path / "model.bin").write_bytes(b"w" * 64)
    (path / "trainer" / "driver.json").write_text(json.dumps({"step": step}))
    if complete:
        write_manifest(path, fsync=False)
    return path


def test_rotation_removes_only_complete_checkpoints(tmp_path):
    from megatron_agent.train.run_state import rotate

    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 1)
    _fake_checkpoint(root, 2, complete=False)  # no manifest: damaged (a save publishes it last)
    assert rotate(root, 1) == []
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002"]
    c3 = _fake_checkpoint(root, 3)
    (c3 / "model.bin").write_bytes(b"w" * 10)  # truncated: not complete
    (root / ".step_000004.tmp-abcd1234").mkdir()  # a staging folder left by a crash
    assert [p.name for p in rotate(root, 1)] == [".step_000004.tmp-abcd1234"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002", "step_000003"]
    _fake_checkpoint(root, 5)
    assert [p.name for p in rotate(root, 1)] == ["step_000001"]
    # the damaged ones stay: their intact files may be all that a user can recover
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003", "step_000005"]


def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _real_layout_checkpoint(root, step):
    """A checkpoint folder with one file of each kind a run writes (contents made up)."""
    from megatron_agent.train.run_state import step_dir

    path = step_dir(root, step)
    for rel, size in (
        ("model/__0_0.distcp", 4096),
        ("optim/__0_0.distcp", 8192),
        ("trainer/worker.pt", 1536),
    ):
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(bytes(range(256)) * (size // 256))
    (path / "trainer" / "driver.json").write_text(json.dumps({"step": step, "history": []}))
    (path / "meta.json").write_text(json.dumps({"step": step}))
    write_manifest(path, fsync=False)
    return path


@pytest.mark.parametrize(
    "damaged", ["model/__0_0.distcp", "optim/__0_0.distcp", "trainer/worker.pt", "manifest.json"]
)
def test_a_damaged_only_checkpoint_is_refused_and_left_as_it_is(tmp_path, damaged):
    # resume=auto over a run folder whose only checkpoint fails: exit 2 before anything starts,
    # the folder and the file named, every byte of the run folder unchanged.
    run_dir = tmp_path / "run"
    ckpt = _real_layout_checkpoint(run_dir / "checkpoints", 1)
    (run_dir / "sft" / "checkpoint").mkdir(parents=True)
    (run_dir / "sft" / "checkpoint" / "meta.json").write_text("{}")
    bad = ckpt / damaged
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    before = _tree(run_dir)
    proc = subprocess.run(
        quickstart_train_cmd(run_dir, "sft.steps=5"),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{ckpt}: " in proc.stderr and "trainer.resume=never" in proc.stderr
    if damaged != "manifest.json":
        assert str(bad) in proc.stderr
    assert _tree(run_dir) == before


def test_nothing_is_written_over(tmp_path):
    # A fresh start (resume=never) moves every step folder and an earlier SFT checkpoint aside;
    # a resume from step 1 moves only the newer ones; no byte is lost either way.
    from megatron_agent.config import load_config
    from megatron_agent.train.run_state import set_aside_before_writing

    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    for step in (1, 2, 3):
        _real_layout_checkpoint(root, step)
    (root / "step_000003" / "trainer" / "worker.pt").write_bytes(b"short")  # damaged
    (run_dir / "sft" / "checkpoint").mkdir(parents=True)
    (run_dir / "sft" / "checkpoint" / "meta.json").write_text("{}")
    resume = (
        f"trainer.resume={root / 'step_000001'}"  # an explicit resume point: newer ones are kept as previous
    )
    cfg = load_config(None, [f"trainer.run_dir={run_dir}", "sft.steps=5", resume], validate=False)
    before = _tree(run_dir)

    moved = set_aside_before_writing(cfg, 1, sft_runs=True)  # resuming from step 1
    assert [p.parent.name.split("-")[0] + "/" + p.name for p in moved] == [
        "previous/step_000002",
        "damaged/step_000003",
    ]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001"]
    assert (run_dir / "sft" / "checkpoint").is_dir()  # the resumed run's reference: kept in place

    moved = set_aside_before_writing(cfg, None, sft_runs=True)  # a fresh start
    assert [p.name for p in moved] == ["step_000001", "checkpoint"]
    assert not list(root.glob("step_*")) and not (run_dir / "sft" / "checkpoint").exists()
    after = _tree(run_dir)
    assert sorted(before.values()) == sorted(after.values())  # every file still there, byte for byte


def test_find_resume_modes(tmp_path, caplog):
    from megatron_agent.config import load_config
    from megatron_agent.train.run_state import find_resume

    root = tmp_path / "ckpts"
    _fake_checkpoint(root, 1)
    c2 = _fake_checkpoint(root, 2)
    (c2 / "model.bin").write_bytes(b"x" * 64)  # same size, other bytes
    cfg = load_config(None, [f"checkpoint.save_dir={root}", f"trainer.run_dir={tmp_path}"])
    path, state = find_resume(cfg)
    assert path.name == "step_000001" and state == {"step": 1}
    assert f"checkpoint file altered: {c2 / 'model.bin'}" in caplog.text
    cfg.trainer.resume = "never"
    assert find_resume(cfg) == (None, None)
    cfg.trainer.resume = str(c2)
    with pytest.raises(ValueError, match="model.bin"):
        find_resume(cfg)
    cfg.trainer.resume = str(tmp_path / "nope")
    with pytest.raises(InputError, match="nope"):
        find_resume(cfg)
    (root / "step_000001" / "model.bin").write_bytes(b"y" * 64)  # now none verifies
    cfg.trainer.resume = "auto"
    with pytest.raises(InputError, match="none of the 2 checkpoint"):
        find_resume(cfg)


def test_first_signal_sets_the_flag_second_stops_at_once():
    from megatron_agent.train.signals import ForcedStop, StopRequest

    previous = signal.getsignal(signal.SIGUSR1)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.name == "SIGUSR1"
        with pytest.raises(ForcedStop) as exc:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGUSR1) == previous
