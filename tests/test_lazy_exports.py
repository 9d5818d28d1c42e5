"""`megatron_agent.lazy_exports`: `megatron_agent.rl` and `megatron_agent.rollout` export every name of
their table from its module on first use, and their light modules import without torch."""

from __future__ import annotations

import importlib
import textwrap

import pytest

import megatron_agent.rl as rl
import megatron_agent.rollout as rollout
from tests.conftest import fresh_python


@pytest.mark.parametrize("package", [rl, rollout], ids=["rl", "rollout"])
def test_every_exported_name_is_its_modules_own(package):
    table = package._MODULE_OF
    assert package.__all__ == sorted(table)
    for name, module in table.items():
        assert getattr(package, name) is getattr(
            importlib.import_module(f"{package.__name__}.{module}"), name
        )
    assert set(table) <= set(dir(package))
    from_import = {}
    exec(f"from {package.__name__} import *", from_import)
    assert set(table) <= set(from_import)


def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        rl.no_such_name  # noqa: B018
    from megatron_agent.rollout import factory  # a submodule, not in the table

    assert factory.__name__ == "megatron_agent.rollout.factory"


def test_the_drivers_light_modules_import_without_torch():
    code = textwrap.dedent(
        """
        import json, sys
        import megatron_agent.rl.kl_controller, megatron_agent.rollout.chat, megatron_agent.rollout.factory
        import megatron_agent.rollout.engine_env, megatron_agent.train.trainer
        print(json.dumps("torch" in sys.modules))
        """
    )
    assert fresh_python(code) is False
