"""Wait until a Ray cluster shows the expected nodes and GPUs, or fail after a timeout.

    python examples/slurm/ray_wait.py --address HEAD:PORT --nodes 4 --gpus 32 --timeout 600

Called by ray_launch.sh on the head node instead of a fixed sleep. Exit status 0 once at least
`--nodes` alive nodes with `--gpus` GPUs in total are in; 1 on timeout, naming what is missing.
"""

from __future__ import annotations

import argparse
import sys
import time


def _alive(nodes: list[dict]) -> list[dict]:
    return [n for n in nodes if n.get("Alive")]


def main(argv: list[str] | None = None) -> int:
    """Poll the cluster every `--poll` seconds until it is complete or `--timeout` has passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="HEAD_IP:PORT of the Ray head")
    parser.add_argument("--nodes", type=int, required=True, help="nodes expected")
    parser.add_argument("--gpus", type=float, default=0, help="GPUs expected in total")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before giving up")
    parser.add_argument("--poll", type=float, default=2, help="seconds between polls")
    args = parser.parse_args(argv)

    import ray

    deadline = time.monotonic() + args.timeout
    while True:  # the head may still be starting: retry the connection itself until the deadline
        try:
            ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
            break
        except (ConnectionError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                print(f"ray_wait: cannot reach the Ray head at {args.address}: {exc}", file=sys.stderr)
                return 1
            time.sleep(args.poll)
    last_report = 0.0
    while True:
        alive = _alive(ray.nodes())
        gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in alive)
        if len(alive) >= args.nodes and gpus >= args.gpus:
            print(f"ray_wait: cluster ready: {len(alive)} nodes, {gpus:g} GPUs", flush=True)
            return 0
        now = time.monotonic()
        if now > deadline:
            hosts = sorted(n.get("NodeManagerHostname", n.get("NodeManagerAddress", "?")) for n in alive)
            print(
                f"ray_wait: timeout after {args.timeout:g}s: {len(alive)}/{args.nodes} nodes "
                f"({', '.join(hosts)}), {gpus:g}/{args.gpus:g} GPUs; check the missing nodes' logs",
                file=sys.stderr,
            )
            return 1
        if now - last_report > 30:
            print(f"ray_wait: {len(alive)}/{args.nodes} nodes, {gpus:g}/{args.gpus:g} GPUs", flush=True)
            last_report = now
        time.sleep(args.poll)


if __name__ == "__main__":
    sys.exit(main())
