"""megatron-agent: RL for tool-calling LLM agents on Megatron-core and vLLM."""

import warnings as _warnings

from megatron_agent.platform import transformers_indexes as _transformers_indexes

# megatron-core warns at import about optional GPU packages (Apex, Transformer Engine) that the
# CPU path deliberately does without; keep the console readable.
_warnings.filterwarnings("ignore", module=r"megatron\.core(\..*)?$")

# transformers' import-time indexes from the per-user cache (platform/transformers_indexes.py),
# installed before any of this package's processes imports transformers.
_transformers_indexes.install()
