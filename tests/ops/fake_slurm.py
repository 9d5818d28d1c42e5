"""Fake `scontrol` and `srun` for running the Slurm launch logic on one machine.

`install_fakes(bin_dir, python)` writes two executables into `bin_dir`:

- `scontrol show hostnames LIST` expands `prefix[1-3,7],other` into one name per line;
  `scontrol requeue ID` only records the call.
- `srun [options] CMD...` runs CMD here with the environment of the node named by `-w`
  (`FAKE_SLURM_NODE_ENV`: JSON {node: {VAR: value}}), in its own process group; signals are
  forwarded to that group, and anything left in it is killed when CMD ends (as Slurm ends a step).

Each call is appended as one JSON line to `$FAKE_SLURM_LOG`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_COMMON = """
import json, os, sys
def record(entry):
    with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")
"""

_SCONTROL = """
import re
def expand(nodelist):
    names = []
    for part in re.findall(r"[^,\\[]+(?:\\[[^\\]]*\\])?", nodelist):
        m = re.fullmatch(r"(.*)\\[(.*)\\]", part)
        if not m:
            names.append(part)
            continue
        for item in m.group(2).split(","):
            lo, _, hi = item.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{m.group(1)}{i:0{len(lo)}d}")
    return names
args = sys.argv[1:]
record({"cmd": "scontrol", "argv": args})
if args[:2] == ["show", "hostnames"]:
    print("\\n".join(expand(args[2])))
elif args[:1] == ["requeue"]:
    pass
else:
    sys.exit(f"fake scontrol: unsupported {args}")
"""

_SRUN = """
import signal, subprocess, time
args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if "=" in opt:
        key, value = opt.split("=", 1)
    elif opt in ("--overlap", "--exclusive"):
        key, value = opt, True
    else:
        key, value = opt, args.pop(0)
    opts[key] = value
node = opts.get("-w") or opts.get("--nodelist") or "localhost"
record({"cmd": "srun", "node": node, "opts": opts, "argv": args})
env = dict(os.environ, SLURMD_NODENAME=node)
env.update(json.loads(os.environ.get("FAKE_SLURM_NODE_ENV", "{}")).get(node, {}))
child = subprocess.Popen(args, env=env, start_new_session=True)
def forward(signum, frame):
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, forward)
rc = child.wait()
try:  # the step ends: nothing it started survives it
    os.killpg(child.pid, signal.SIGTERM)
    time.sleep(1)
    os.killpg(child.pid, signal.SIGKILL)
except ProcessLookupError:
    pass
sys.exit(rc if rc >= 0 else 128 - rc)
"""


def install_fakes(bin_dir: str | os.PathLike, python: str) -> Path:
    """Write the fake `scontrol` and `srun` into `bin_dir` (run by `python`); return the folder."""
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("scontrol", _SCONTROL), ("srun", _SRUN)):
        path = bin_dir / name
        path.write_text(f"#!{python}\n{_COMMON}{body}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir
