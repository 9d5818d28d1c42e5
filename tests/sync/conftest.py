"""Fixtures of the weight-sync tests: the torchrun launches, run once per session and shared."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun

# layout -> tiny model: together they cover tied (also under VPP) and untied embeddings, Qwen2's
# QKV bias under TP, Qwen3's q/k norm (head_dim != hidden / heads) under TP x PP, and the
# 400-row vocabulary padded to 512 everywhere. 4 ranks: every layout but 2x2 is also data parallel.
LAYOUT_MODELS = {
    "1x1": "llama_tied",
    "2x1": "qwen2",
    "1x2": "llama_untied",
    "2x2": "qwen3",
    "1x2v2": "llama_tied",
}
SMALL_BUCKETS = "1x2v2"  # 64 KiB buckets: many buckets, and gate/up units larger than a bucket
EXPORT_LAYOUT = "2x2"


@pytest.fixture(scope="session")
def sync_layouts(tiny_models, tmp_path_factory):
    """Results of the layout launch (see tests/sync/sync_worker.py) and its output folder."""
    out = tmp_path_factory.mktemp("sync_layouts")
    run_torchrun(
        [
            "tests/sync/sync_worker.py",
            "--mode",
            "layouts",
            "--layouts",
            *(f"{layout}={tiny_models[name]}" for layout, name in LAYOUT_MODELS.items()),
            "--small-buckets",
            SMALL_BUCKETS,
            "--export-layout",
            EXPORT_LAYOUT,
            "--out-dir",
            str(out),
            "--cache",
            str(tmp_path_factory.mktemp("sync_vllm_cache")),
        ],
        nproc=4,
        timeout=1500,
    )
    return json.loads((out / "layouts.json").read_text()), out


@pytest.fixture(scope="session")
def sync_failures(tiny_models, tmp_path_factory):
    """Error messages of the failure launch (one rank, qwen2, engine in its own process)."""
    out = tmp_path_factory.mktemp("sync_failures")
    run_torchrun(
        [
            "tests/sync/sync_worker.py",
            "--mode",
            "failures",
            "--model",
            str(tiny_models["qwen2"]),
            "--out-dir",
            str(out),
            "--cache",
            str(tmp_path_factory.mktemp("sync_vllm_cache")),
        ],
        nproc=1,
        timeout=900,
    )
    return json.loads((out / "failures.json").read_text())
