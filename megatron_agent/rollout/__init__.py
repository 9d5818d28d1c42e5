"""Rollout: the engine adapter (vLLM), the multi-turn agent loop and trajectories with provenance.

It knows no Megatron: weights come in as `(hf_name, tensor)` pairs through
`VLLMEngine.update_weights`, trajectories go out as `Trajectory` objects, padded tensors
(`build_training_batch`) and rollout dumps (`write_rollout_dump`).
"""

from megatron_agent.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_agent.rollout.dump import read_rollout_dump, rollout_dump_path, write_rollout_dump
from megatron_agent.rollout.engine import GenerationOutput, SamplingConfig
from megatron_agent.rollout.metrics import rollout_metrics
from megatron_agent.rollout.trajectory import TokenSource, ToolCallRecord, Trajectory, build_training_batch

__all__ = [
    "AgentLoop",
    "AgentLoopConfig",
    "GenerationOutput",
    "SamplingConfig",
    "TokenSource",
    "ToolCallRecord",
    "Trajectory",
    "build_training_batch",
    "read_rollout_dump",
    "rollout_dump_path",
    "rollout_metrics",
    "write_rollout_dump",
]
