"""Silent sync failures are caught, and a dead or stopped engine gives an error, not a hang.

A skipped sync and a partial one (a bucket dropped, also with its manifest entry) must be caught
by the probe or the bucket manifest; a byte flipped in shared memory by the checksum, naming
the tensor. The engine is a real vLLM in its own process; the faults are injected between the
sender and it.
"""

from __future__ import annotations


def test_good_syncs_pass(sync_failures):
    for key in ("first", "recovered"):
        metrics = sync_failures[key]["ok"]
        assert metrics["sync/verified"] == 1.0 and metrics["sync/probe_max_abs"] < 1e-4, key


def test_skipped_sync_is_caught_by_the_probe(sync_failures):
    msg = sync_failures["skipped"]["error"]
    assert "probe sequence" in msg and "position" in msg and "engine log-prob" in msg and "actor" in msg


def test_dropped_bucket_is_caught_by_the_manifest(sync_failures):
    msg = sync_failures["dropped"]["error"]
    assert "never reached the engine" in msg and "bucket 1" in msg and "model.layers." in msg


def test_dropped_bucket_without_a_trace_is_caught_by_the_probe(sync_failures):
    msg = sync_failures["dropped_hidden"]["error"]
    assert "probe failed" in msg and "probe sequence" in msg


def test_corrupted_bucket_is_caught_by_the_checksum_naming_the_tensor(sync_failures):
    result = sync_failures["corrupted"]
    assert "checksum mismatch" in result["error"]
    assert f"tensor {result['tensor']} " in result["error"]


def test_stopped_engine_times_out(sync_failures):
    result = sync_failures["stopped"]
    assert "did not answer" in result["error"] and f"pid {sync_failures['pid']}" in result["error"]
    assert result["seconds"] < 3 + 5  # sync.timeout_s=3, plus polling slack on a loaded machine


def test_killed_engine_is_named_with_its_exit_code(sync_failures):
    result = sync_failures["killed"]
    assert f"pid {sync_failures['pid']}" in result["error"] and "exit code -9" in result["error"]
    assert result["seconds"] < 30
