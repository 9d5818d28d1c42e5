"""Every config field's constraint, checked at load time: one case per constrained field.

For each leaf field: a choice (`Literal`) or a number with a `Range` loads with a valid value
other than its default and fails with an out-of-range or unknown one, the key named in the
message. A number field without a range fails `test_every_number_has_a_range` unless it is listed
in FREE with the reason. Then: every problem is reported at once, the checks between fields, and
a YAML file that is not one (bad YAML, a key given twice, a folder, a missing file).
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megatron_agent.config import Config, ConfigError, load_config
from megatron_agent.config.constraints import Range, annotated_fields, range_of
from megatron_agent.config.load import KEY_OF_FIELD

FREE = {
    "algorithm.entropy_coef": "a negative weight penalises entropy: a choice, not a mistake",
}
"""Number fields that take any value, and why."""


def _leaves(cls=Config, prefix=""):
    """(dotted key, annotated type, default) of every leaf field."""
    hints, defaults = annotated_fields(cls), cls()
    for f in dataclasses.fields(cls):
        key, typ = f"{prefix}{KEY_OF_FIELD.get(f.name, f.name)}", hints[f.name]
        bare = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(bare):
            yield from _leaves(bare, f"{key}.")
        else:
            yield key, typ, getattr(defaults, f.name)


def _number_type(typ) -> type | None:
    """int or float when the field holds numbers (possibly Optional or a list of them)."""
    bare = typing.get_origin(typ) is typing.Annotated and typing.get_args(typ)[0] or typ
    args = typing.get_args(bare) if typing.get_origin(bare) else (bare,)
    for arg in args:
        inner = _number_type(arg) if typing.get_origin(arg) else arg
        if inner in (int, float):
            return inner
    return None


def _candidates(bounds: Range, default, kind: type) -> list:
    points = [p for p in (bounds.ge, bounds.gt, bounds.le, bounds.lt, 0, 1) if p is not None]
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        points.append(default)
    values = sorted({p + d for p in points for d in (-1, -0.5, 0, 0.5, 1, 16)})
    return [kind(v) for v in values if kind is float or float(v).is_integer()]


def _text(value, default) -> str:
    return f"[{value}]" if isinstance(default, list) else str(value)


def _cases():
    for key, typ, default in _leaves():
        if typing.get_origin(typ) is typing.Literal:
            choices = typing.get_args(typ)
            valid = next(c for c in choices if c != default)
            yield pytest.param(key, valid or "''", valid, "bogus", id=key)
            continue
        bounds, kind = range_of(typ), _number_type(typ)
        if bounds is None or kind is None:
            continue
        cands = _candidates(bounds, default if not isinstance(default, list) else default[0], kind)
        valid = next(v for v in cands if bounds.contains(v) and v != default)
        invalid = next(v for v in cands if not bounds.contains(v))
        yield pytest.param(key, _text(valid, default), valid, _text(invalid, default), id=key)


def _get(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, {v: k for k, v in KEY_OF_FIELD.items()}.get(part, part))
    return obj


@pytest.mark.parametrize(("key", "valid_text", "valid", "invalid_text"), list(_cases()))
def test_each_constrained_field(key, valid_text, valid, invalid_text):
    """A valid non-default value loads; an invalid one is refused at load with the key named."""
    cfg = load_config(None, [f"{key}={valid_text}"], validate=False)
    got = _get(cfg, key)
    assert (got[0] if isinstance(got, list) else got) == valid
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}={invalid_text}"], validate=False)
    assert key.rsplit(".", 1)[-1] in str(info.value) and key.split(".")[0] in str(info.value)


def test_every_number_has_a_range():
    """A new number field must say its range (or be listed as free, with the reason)."""
    missing = [
        key
        for key, typ, _ in _leaves()
        if _number_type(typ) is not None and range_of(typ) is None and key not in FREE
    ]
    assert not missing, f"number fields without a Range (add one, or list them in FREE): {missing}"
    assert set(FREE) <= {key for key, _, _ in _leaves()}, "FREE names a field that does not exist"


def test_every_problem_is_reported_at_once():
    overrides = [
        "actor.ppo_mini_batch_size=-4",
        "trainer.total_steps=-1",
        "rollout.top_p=5",
        "algorithm.loss_agg_mode=bogus",
        "rolout.n=2",
        "actor.lr=abc",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    text = str(info.value)
    assert text.startswith("6 problems in the config:")
    for needle in (
        "actor.ppo_mini_batch_size=-4 must be >= 0",
        "trainer.total_steps=-1 must be >= 0",
        "rollout.top_p=5.0 must be > 0 and <= 1",
        "loss_agg_mode",
        "did you mean 'rollout.n'",
        "actor.lr' expects float",
    ):
        assert needle in text


def test_checks_between_fields_are_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            [
                "data.train_batch_size=6",
                "actor.ppo_mini_batch_size=4",
                "rollout.max_new_tokens=600",
                "actor.min_lr=1",
                "tools.enabled=[calculater]",
            ],
        )
    text = str(info.value)
    assert text.startswith("4 problems")
    assert "not divisible by actor.ppo_mini_batch_size=4" in text
    assert "rollout.max_new_tokens=600 must be < rollout.max_total_tokens=512" in text
    assert "actor.min_lr=1 exceeds actor.lr" in text
    assert "did you mean 'calculator'?" in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "trainer:\n  total_steps: 3\n  seed: 1\n  total_steps: 4\n",
            "key 'total_steps' is given twice (lines 2 and 4)",
        ),
        ("trainer:\n  seed: 1\ntrainer:\n  seed: 2\n", "key 'trainer' is given twice (lines 1 and 3)"),
        ("trainer: [1\n", "is not valid YAML at line 2"),
        ("- a\n- b\n", "the top level must be a mapping"),
    ],
)
def test_bad_yaml_files_are_named(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_a_config_that_is_a_folder_or_missing(tmp_path):
    with pytest.raises(ConfigError, match="is a folder; give a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "none.yaml")
