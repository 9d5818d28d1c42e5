"""megatron-agent: RL for tool-calling LLM agents on Megatron-core and vLLM."""

import warnings as _warnings

# megatron-core warns at import about optional GPU packages (Apex, Transformer Engine) that the
# CPU path deliberately does without; keep the console readable.
_warnings.filterwarnings("ignore", module=r"megatron\.core(\..*)?$")
