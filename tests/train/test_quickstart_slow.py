"""The quickstart learns: validation accuracy at the last step is >= 0.15 above step 0 (after SFT),
for two seeds, synchronous and asynchronous (eta = 1, the decoupled loss), and with PPO's critic
(examples/quickstart/ppo.yaml). Slow (the whole `make run` job six times); run with
`make test-slow`."""

import json
import os
import subprocess

import pytest

from tests.conftest import REPO, quickstart_train_cmd

MODES = {
    "sync": [],
    "async": ["trainer.mode=async", "async.max_staleness=1", "algorithm.off_policy_loss=decoupled"],
    "ppo": [],  # with examples/quickstart/ppo.yaml
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seed", [0, 1])
def test_quickstart_validation_accuracy_rises(tmp_path, seed, mode):
    run_dir = tmp_path / f"seed{seed}"
    cmd = quickstart_train_cmd(
        run_dir, f"trainer.seed={seed}", f"sft.seed={7 + seed}", f"data.seed={1234 + seed}", *MODES[mode]
    )
    if mode == "ppo":
        cmd[cmd.index("examples/quickstart/config.yaml")] = "examples/quickstart/ppo.yaml"
    proc = subprocess.run(
        cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=3600
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    first, last = val[0], val[max(val)]
    print(f"{mode}, seed {seed}: val/accuracy {val}")
    assert last >= first + 0.15, val
