"""Workers that fail to start, for the start-up tests (`Trainer.start(actor_cls=..., engine_cls=...)`):
a Megatron rank whose `setup` raises and a rollout engine whose constructor raises."""

from __future__ import annotations

from megatron_agent.train.megatron_worker import MegatronWorker
from megatron_agent.train.rollout_worker import RolloutWorker

SETUP_REASON = "the actor's weights do not fit (a test's failing setup)"
ENGINE_REASON = "vLLM could not allocate its KV cache (a test's failing engine)"


class FailingSetupMegatronWorker(MegatronWorker):
    """A Megatron rank that starts, then raises in `setup` (as a rank that cannot build its model)."""

    def setup(self, master_addr: str, master_port: int, init_from: str = "") -> dict:
        print(f"rank {self.rank} setting up", flush=True)
        raise RuntimeError(SETUP_REASON)


class FailingEngine(RolloutWorker):
    """A rollout engine whose constructor raises after it opened its log (before vLLM is built)."""

    def __init__(self, rank: int, num_engines: int, log_path: str, cfg_dict: dict, plan_dict: dict):
        from megatron_agent.train.cluster import redirect_output

        redirect_output(log_path)
        print(f"engine {rank} starting", flush=True)
        raise RuntimeError(ENGINE_REASON)
