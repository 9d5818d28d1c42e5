"""Rollout: the engine adapter (vLLM), the multi-turn agent loop and trajectories with provenance.

It knows no Megatron: weights come in as `(hf_name, tensor)` pairs through
`VLLMEngine.update_weights`, trajectories go out as `Trajectory` objects, padded tensors
(`build_training_batch`) and rollout dumps (`write_rollout_dump`).

The names below are imported from their modules on first use (`megatron_agent/lazy_exports.py`): the
driver reads prompts with `rollout.chat` before its workers start, without torch or vLLM.
"""

from __future__ import annotations

from megatron_agent.lazy_exports import lazy_exports

_MODULE_OF = {
    "AgentLoop": "agent_loop",
    "AgentLoopConfig": "agent_loop",
    "read_rollout_dump": "dump",
    "rollout_dump_path": "dump",
    "write_rollout_dump": "dump",
    "GenerationOutput": "engine",
    "SamplingConfig": "engine",
    "rollout_metrics": "metrics",
    "TokenSource": "trajectory",
    "ToolCallRecord": "trajectory",
    "Trajectory": "trajectory",
    "build_training_batch": "trajectory",
}

__all__ = sorted(_MODULE_OF)

__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)
