"""Device and backend choice, the CPU redirection for megatron-core, and seeding."""

from megatron_agent.platform.setup import (
    backend_name,
    device,
    has_cuda,
    init_distributed,
    seed_everything,
)

__all__ = ["backend_name", "device", "has_cuda", "init_distributed", "seed_everything"]
