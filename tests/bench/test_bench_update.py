"""bench/update.py: a quickstart-size run (one warm-up, one timed round) whose last line parses.

The ratio is not asserted against its target (timing belongs to the benchmark), only that both
updates ran on the same model (their first log-probs agree) and that the last line is the size
line's ratio.
"""

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_size_prints_the_update_ratio():
    cmd = [sys.executable, "bench/update.py", "--sizes", "quickstart", "--rounds", "1", "--warmup", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    size = [line for line in lines if line.startswith("size=quickstart ")]
    assert len(size) == 1, proc.stdout
    fields = dict(item.split("=", 1) for item in size[0].split())
    assert float(fields["ours_s"]) > 0 and float(fields["plain_s"]) > 0
    assert float(fields["first_logp_maxdiff"]) < 1e-3  # same weights, same tokens
    last = re.fullmatch(r"update_ratio=(\S+)", lines[-1])
    assert last, lines[-1]
    ratio = float(last.group(1))
    assert math.isfinite(ratio) and ratio > 0
    assert fields["update_ratio"] == last.group(1)
