"""What the raylet of a lean local cluster starts in place of Ray's dashboard agent.

The raylet always starts two agents and fate-shares with them: the runtime-env agent (which a
run uses: every actor's environment variables go through it) and the dashboard agent, whose
services a local run does not use (metrics export, log serving, job submission, node stats,
events). Before the raylet registers its node it waits until the dashboard agent has written
the ports of those services into the session folder; Ray's own minimal agent (what a Ray without
its dashboard's dependencies runs) writes -1 for a service it does not serve, which the raylet
and every worker read as "no metrics agent" and go on without it.

This stand-in writes -1 for each port file it is given, then waits, holding no Ray module: about
9 MB resident against the agent's 130 MB, and none of its 0.8 s of CPU at start (which the
engines' and the Megatron ranks' starts share two cores with on a small machine). It ends when
its parent (the raylet) is gone, and on SIGTERM (the raylet's own shutdown).

    python -S -I dashboard_agent_stand_in.py PORT_FILE...   (what train/cluster.py gives the raylet)

Standard library only: it runs isolated from the project and its environment.
"""

import os
import sys
import time

UNUSED_PORT = "-1"
"""What Ray writes for a service its agent does not serve."""


def write_unused(path: str) -> None:
    """Write `UNUSED_PORT` to `path` atomically (the raylet polls for the file)."""
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w") as f:
        f.write(UNUSED_PORT)
    os.replace(staging, path)


def main(paths: list[str]) -> int:
    """Write every port file, then wait until the parent process is gone."""
    parent = os.getppid()
    for path in paths:
        write_unused(path)
    while os.getppid() == parent:
        time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
