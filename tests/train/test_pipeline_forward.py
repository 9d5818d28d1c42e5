"""The training forward at PP2 x VPP2 computes the same log-probs as the forward-only pass.

At PP2 with a virtual pipeline, a rank's previous and next stage are the same rank, so in the
steady state of the interleaved schedule an activation and a gradient travel between the same
two ranks in one exchange. Batched p2p over gloo paired them by posting order and swapped them:
every micro-batch after the first PP ones trained on another tensor (found when the RL update's
on-policy ratio was not 1). The forward-only pass never exchanges gradients, so only a training
forward shows it.
"""

import json

from tests.conftest import run_torchrun


def test_training_forward_matches_forward_only_at_pp2_vpp2(tiny_models, tmp_path):
    out = tmp_path / "diffs.json"
    run_torchrun(
        [
            "tests/train/pipeline_forward_worker.py",
            "--model",
            str(tiny_models["llama_untied"]),
            "--out",
            str(out),
        ],
        nproc=2,
    )
    result = json.loads(out.read_text())
    assert result["num_micro_batches"] == 8  # several steady-state exchanges
    assert max(result["max_abs_diff"]) < 1e-5, result["max_abs_diff"]
