"""`destroy_model_parallel` destroys the gloo process groups its layout made (megatron-core only
drops its references, and each leaked gloo group kept its threads: a process that built many
layouts slowed down with each), and the default group stays; at exit every gloo group goes, so a
process that ends right after a collective exits 0 (not -6, `platform/setup.py`)."""

from __future__ import annotations

import textwrap

from tests.conftest import fresh_python

LAYOUTS = textwrap.dedent(
    """
    import json
    import torch
    import torch.distributed as dist
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel, process_groups

    counts = []
    for _ in range(3):
        init_model_parallel(1, 1)
        counts.append(len(process_groups()))
        destroy_model_parallel()
        counts.append(len(process_groups()))
    init_model_parallel(1, 1)
    init_model_parallel(1, 1)  # a second layout without a destroy between: the first one's go
    counts.append(len(process_groups()))
    destroy_model_parallel()
    total = torch.ones(2)
    dist.all_reduce(total)  # the default group still works
    import atexit
    atexit._run_exitfuncs()  # what a normal exit runs first, before the interpreter finalizes
    print(json.dumps({"counts": counts, "total": total.tolist(), "left": len(process_groups()),
                      "initialized": dist.is_initialized()}))
    """
)


def test_destroy_model_parallel_destroys_the_groups_its_layout_made():
    report = fresh_python(LAYOUTS)
    made, after = report["counts"][0], report["counts"][1]
    assert after == 1 and made > 5, report  # only the default group outlives a layout
    assert report["counts"] == [made, 1] * 3 + [made], report  # nothing accumulates
    assert report["total"] == [1.0, 1.0]
    assert report["left"] == 0 and not report["initialized"], report  # joined before finalizing
