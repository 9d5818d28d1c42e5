"""`platform.hidden_imports`: optional packages hidden while a library imports, importable after;
and a Megatron rank's start (`init_model_parallel`) without wandb and TensorBoard."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap

import pytest

from megatron_agent.platform.hidden_imports import hidden_imports
from tests.conftest import fresh_python


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Two importable packages, `hid_optional` and `hid_user`: the user imports the optional one
    the way libraries do (`try: import ... except ImportError`) and records which path it took."""
    (tmp_path / "hid_optional").mkdir()
    (tmp_path / "hid_optional" / "__init__.py").write_text("VALUE = 7\n")
    (tmp_path / "hid_optional" / "sub.py").write_text("VALUE = 8\n")
    (tmp_path / "hid_user.py").write_text(
        "try:\n    import hid_optional\nexcept ImportError:\n    hid_optional = None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("hid_optional", "hid_optional.sub", "hid_user"):
        sys.modules.pop(name, None)


def test_a_hidden_package_is_not_installed_within_the_block_and_imports_after_it(packages):
    with hidden_imports(["hid_optional"]) as hidden:
        assert hidden == ["hid_optional"]
        assert importlib.util.find_spec("hid_optional") is None  # availability checks say "absent"
        with pytest.raises(ImportError):
            import hid_optional  # noqa: F401
        with pytest.raises(ImportError):
            importlib.import_module("hid_optional.sub")
        import hid_user  # its guarded import takes the not-installed path
    assert hid_user.hid_optional is None  # and keeps it
    assert importlib.import_module("hid_optional.sub").VALUE == 8
    assert importlib.import_module("hid_optional").VALUE == 7
    assert importlib.util.find_spec("hid_optional") is not None


def test_a_package_imported_already_is_not_hidden(packages):
    import hid_optional

    with hidden_imports(["hid_optional"]) as hidden:
        assert hidden == []
        assert importlib.import_module("hid_optional") is hid_optional
    assert sys.modules["hid_optional"] is hid_optional


def test_the_block_undoes_itself_when_the_import_inside_fails(packages):
    with pytest.raises(RuntimeError, match="inside"):
        with hidden_imports(["hid_optional"]):
            raise RuntimeError("a failure inside the block")
    assert importlib.import_module("hid_optional").VALUE == 7


RANK = textwrap.dedent(
    """
    import json, sys
    from megatron_agent.platform.parallel import MEGATRON_UNUSED_IMPORTS, destroy_model_parallel, init_model_parallel

    init_model_parallel(1, 1)
    from megatron.core import timers

    seen = {name: name in sys.modules for name in MEGATRON_UNUSED_IMPORTS}
    writer = timers.SummaryWriter
    import wandb  # importable again once megatron-core has imported (the run log's own use)
    from torch.utils.tensorboard import SummaryWriter

    destroy_model_parallel()
    print(json.dumps({"seen": seen, "timers_wandb": timers.wandb is None, "writer": writer is None,
                      "wandb_after": wandb.__name__, "tensorboard_after": SummaryWriter.__name__}))
    """
)


def test_a_megatron_rank_starts_without_wandb_and_tensorboard():
    """A fresh process, as a worker: megatron-core's timers take their not-installed path, the
    rank never loads either package, and later imports of both still work."""
    report = fresh_python(RANK)
    assert report == {
        "seen": {"wandb": False, "tensorboard": False},
        "timers_wandb": True,
        "writer": True,
        "wandb_after": "wandb",
        "tensorboard_after": "SummaryWriter",
    }, report
