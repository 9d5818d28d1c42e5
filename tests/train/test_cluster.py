"""Worker failures surface as errors naming the worker, its rank and its log's tail; never a hang."""

import os
import time

import pytest

from megatron_agent.train.cluster import WorkerError, WorkerGroup, start_ray, stop_ray


class Flaky:
    """A worker whose ranks misbehave on request."""

    def __init__(self, rank, world, log_path):
        from megatron_agent.train.cluster import redirect_output

        redirect_output(log_path)
        self.rank = rank

    def work(self, mode):
        print(f"rank {self.rank} starting {mode}", flush=True)
        if self.rank == 1 and mode == "raise":
            raise ValueError("tool index missing on rank 1")
        if self.rank == 1 and mode == "die":
            os._exit(3)
        if self.rank == 1 and mode == "hang":
            time.sleep(600)
        return self.rank * 10


@pytest.fixture(scope="module")
def ray_cluster():
    start_ray(num_cpus=2)
    yield
    stop_ray()


@pytest.mark.parametrize(
    "mode, message",
    [
        ("raise", "flaky worker rank 1 raised in work()"),
        ("die", "flaky worker rank 1 died during work()"),
        ("hang", "flaky worker rank 1 did not finish work() within 3 s"),
    ],
)
def test_failing_worker_is_named_with_its_log(ray_cluster, tmp_path, mode, message):
    group = WorkerGroup(Flaky, 2, name="flaky", log_dir=tmp_path, num_cpus=0, timeout_s=60)
    try:
        assert group.call("work", "ok") == [0, 10]
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            group.call("work", mode, timeout_s=3)
        assert time.monotonic() - start < 30
        text = str(err.value)
        assert message in text
        assert f"last lines of {tmp_path / 'flaky_1.log'}" in text and f"rank 1 starting {mode}" in text
        if mode == "raise":
            assert "tool index missing on rank 1" in text
    finally:
        group.kill()
