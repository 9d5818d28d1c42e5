"""Runs python-tool calls for the hostile-snippet suite in a process of its own.

    python tests/envs/sandbox_runner.py '{"memory_mb": 384, ...}'

reads one JSON object per line from stdin ({"code": ...}, or {"codes": [...]} to run them all
at once) and answers one per line ({"status", "text", "seconds", "peak"}, or a list), through `ToolSet.run`: the path the agent loop
uses. The suite starts it as an unprivileged user to reach the rlimit path on a machine where
the tests run as root (which needs a cgroup, so root never takes that path itself).
"""

from __future__ import annotations

import asyncio
import json
import sys


def main() -> None:
    """Serve calls until stdin closes."""
    from megatron_agent.envs.tools import ToolSet
    from megatron_agent.envs.tools.python import Python

    kwargs = json.loads(sys.argv[1])
    tool = Python(**kwargs)
    tools = ToolSet([tool], timeout_s=kwargs.get("timeout_s", 10.0))
    print(json.dumps({"path": tool.path, "process_mb": tool.process_memory_bytes >> 20}), flush=True)

    async def serve() -> None:
        for line in sys.stdin:
            request = json.loads(line)
            if "codes" in request:  # all at once
                results = await asyncio.gather(*(tools.run("python", {"code": c}) for c in request["codes"]))
                print(json.dumps([{"status": r.status, "text": r.text} for r in results]), flush=True)
                continue
            result = await tools.run("python", {"code": request["code"]})
            answer = {"status": result.status, "text": result.text, "seconds": result.seconds}
            print(json.dumps(answer | {"peak": tool.last_peak_bytes}), flush=True)

    asyncio.run(serve())


if __name__ == "__main__":
    main()
