"""megatron-agent: RL for tool-calling LLM agents on Megatron-core and vLLM."""
