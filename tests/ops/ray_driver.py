"""A stand-in driver for the launch tests: joins the Ray cluster named by `ray.address=...`.

    python ray_driver.py ray.address=HOST:PORT --out FILE [--wait-signal S]

Writes {"address", "nodes", "pid", "env"} to FILE once connected; with `--wait-signal S` it then
waits up to S seconds for SIGUSR1 (as the trainer does before a Slurm time limit), records
"checkpointed": true in FILE and exits 0.
"""

import argparse
import json
import os
import signal
import sys
import time

FORWARDED = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "HF_HOME", "VLLM_CACHE_ROOT", "RAY_ADDRESS")


def main() -> int:
    """Connect, report, optionally wait for SIGUSR1."""
    parser = argparse.ArgumentParser()
    parser.add_argument("override")
    parser.add_argument("--out", required=True)
    parser.add_argument("--wait-signal", type=float, default=0)
    args = parser.parse_args()
    key, _, address = args.override.partition("=")
    assert key == "ray.address", args.override
    got = {"signal": False}
    signal.signal(signal.SIGUSR1, lambda s, f: got.update(signal=True))

    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    report = {
        "address": address,
        "nodes": len([n for n in ray.nodes() if n["Alive"]]),
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in FORWARDED},
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, args.out)
    deadline = time.monotonic() + args.wait_signal
    while time.monotonic() < deadline and not got["signal"]:
        time.sleep(0.2)
    if got["signal"]:
        report["checkpointed"] = True
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
