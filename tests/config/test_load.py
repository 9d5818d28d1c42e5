"""The config tree: YAML plus dotted overrides, typed values, unknown keys named with a suggestion."""

import pytest

from megatron_agent.config import ConfigError, load_config


def test_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "parallel:\n  tp: 2\nrollout:\n  temperature: 0.7\ntools:\n  enabled: [calculator, search]\n"
    )
    cfg = load_config(
        path, ["parallel.pp=2", "actor.lr=3e-6", "logging.tensorboard=true", "tools.enabled=search"]
    )
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)
    assert cfg.rollout.temperature == 0.7
    assert cfg.actor.lr == 3e-6
    assert cfg.logging.tensorboard is True
    assert cfg.tools.enabled == ["search"]
    assert cfg.trainer.total_steps == 10  # untouched default


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.tpp=2", "unknown config key 'parallel.tpp'; did you mean 'parallel.tp'?"),
        (
            "rollout.temprature=0.5",
            "unknown config key 'rollout.temprature'; did you mean 'rollout.temperature'?",
        ),
        ("actr.lr=1", "unknown config key 'actr.lr'; did you mean 'actor.lr'?"),
        ("parallel.tp=two", "config key 'parallel.tp' expects int, got 'two'"),
        ("logging.tensorboard=maybe", "config key 'logging.tensorboard' expects true/false"),
        ("parallel.tp", "is not of the form key=value"),
    ],
)
def test_bad_overrides_are_named(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_unknown_yaml_key_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  kl_loss_coeff: 0.1\n")
    with pytest.raises(
        ConfigError,
        match="unknown config key 'algorithm.kl_loss_coeff'; did you mean 'algorithm.kl_loss_coef'",
    ):
        load_config(path)
