"""Loading a config: defaults, then a YAML file, then dotted `key=value` overrides.

`load_config(path, overrides)` checks every value's type, choice and range (`constraints.py`),
rejects unknown keys with the nearest valid spelling and a YAML key given twice, and reports
every such error at once; then it runs the one validation pass (`validate_config`) holding every
check between fields and every check that needs no worker. Workers rebuild the same tree from
its dict (`config_from_dict`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from megatron_agent.config.constraints import field_violations
from megatron_agent.config.schema import Config, ConfigError
from megatron_agent.config.validate import validate_config

KEY_OF_FIELD = {"async_": "async"}
"""Fields whose name in YAML and overrides differs (a Python keyword cannot name a field)."""
FIELD_OF_KEY = {key: name for name, key in KEY_OF_FIELD.items()}


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _all_dotted_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        sub = _resolve_type(cls, f)
        name = KEY_OF_FIELD.get(f.name, f.name)
        if dataclasses.is_dataclass(sub):
            keys.extend(_all_dotted_keys(sub, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _unknown_key_error(key: str, value: Any, prefix: str) -> ConfigError:
    """An error naming the full dotted key the user wrote and the nearest valid one."""
    full = f"{prefix}{key}"
    while isinstance(value, dict) and len(value) == 1:  # follow a single-key override down
        ((sub, value),) = value.items()
        full = f"{full}.{sub}"
    near = difflib.get_close_matches(full, _all_dotted_keys(Config), n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return ConfigError(f"unknown config key '{full}'{hint}")


def _resolve_type(cls, f: dataclasses.Field):
    hints = typing.get_type_hints(cls)
    return hints[f.name]


def _coerce(value: Any, typ, key: str) -> Any:
    """Convert `value` (from YAML or a command-line string) to `typ`, or raise naming `key`."""
    origin = typing.get_origin(typ)
    if origin is typing.Literal:
        choices = typing.get_args(typ)
        text = "" if value is None else str(value)
        if text not in choices:
            shown = ", ".join(repr(c) if c == "" else c for c in choices)
            raise ConfigError(f"config key '{key}'={value!r}: choose one of {shown}")
        return text
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, args[0], key)
    if origin is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, str):
            import yaml

            parsed = yaml.safe_load(value) if value.strip().startswith("[") else value.split(",")
            value = [] if value.strip() in ("", "[]") else parsed
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(v, item, key) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' expects a mapping, got {value!r}")
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"config key '{key}' expects true/false, got {value!r}")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' expects {typ.__name__}, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key '{key}' expects {typ.__name__}, got {value!r}") from None
        if typ is int:
            if not number.is_integer():
                raise ConfigError(f"config key '{key}' expects int, got {value!r}")
            return int(number)
        return number
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{key}' expects a string, got {value!r}")
        return str(value)
    return value


def _apply_mapping(obj, mapping: dict, prefix: str = "", errors: list[str] | None = None) -> None:
    """Set `obj`'s fields from `mapping`; each bad key or value is appended to `errors` (raised
    at once when `errors` is None)."""
    cls = type(obj)
    names = _field_names(cls)
    for key, value in mapping.items():
        try:
            key = FIELD_OF_KEY.get(key, key)
            if key not in names:
                raise _unknown_key_error(key, value, prefix)
            f = next(f for f in dataclasses.fields(cls) if f.name == key)
            typ = _resolve_type(cls, f)
            if dataclasses.is_dataclass(typ):
                if not isinstance(value, dict):
                    raise ConfigError(f"config section '{prefix}{key}' expects a mapping, got {value!r}")
                _apply_mapping(getattr(obj, key), value, f"{prefix}{KEY_OF_FIELD.get(key, key)}.", errors)
            else:
                setattr(obj, key, _coerce(value, typ, f"{prefix}{key}"))
        except ConfigError as exc:
            if errors is None:
                raise
            errors.append(str(exc))


def apply_override(cfg: Config, override: str, errors: list[str] | None = None) -> None:
    """Apply one `dotted.key=value` override to `cfg` in place (errors as in `_apply_mapping`)."""
    if "=" not in override:
        problem = f"override {override!r} is not of the form key=value (e.g. parallel.tp=2)"
        if errors is None:
            raise ConfigError(problem)
        errors.append(problem)
        return
    key, value = override.split("=", 1)
    parts = key.strip().split(".")
    nested: dict = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        nested = {part: nested}
    _apply_mapping(cfg, nested, errors=errors)


def read_yaml(path: str | Path) -> dict:
    """The mapping of a YAML config file; a missing file, a folder, bad YAML, a top level that is
    not a mapping or a key given twice in one mapping is a `ConfigError` naming the file (and lines)."""
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--config {path} is a folder; give a YAML file")
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path} is not valid YAML{at}: {problem}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _unique_key_loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """A SafeLoader that refuses a key given twice in one mapping (YAML would keep the last)."""

        def construct_mapping(self, node, deep=False):
            first_line: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (list, dict)):
                    continue  # not a valid key at all: SafeLoader says so
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise ConfigError(
                        f"key '{key}' is given twice (lines {first_line[key]} and {line}); keep one"
                    )
                first_line[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *, validate: bool = True
) -> Config:
    """Build a `Config` from defaults, an optional YAML file, then `key=value` overrides, and
    validate it (`validate=False`: types, choices and ranges only, for commands that read a few
    sections). Every unknown key, bad type, choice or range is reported in one `ConfigError`."""
    cfg, errors = Config(), []
    if path:
        _apply_mapping(cfg, read_yaml(path), errors=errors)
    for override in overrides:
        apply_override(cfg, override, errors)
    errors += field_violations(cfg, key_of_field=KEY_OF_FIELD)
    if errors:
        raise ConfigError.of(errors)
    if validate:
        validate_config(cfg)
    return cfg


def config_from_dict(data: dict) -> Config:
    """A `Config` rebuilt from `config_to_dict` output (what the driver ships to workers)."""
    cfg = Config()
    _apply_mapping(cfg, data)
    return cfg


def config_to_dict(cfg) -> dict:
    """The config as plain nested dicts, keyed as in YAML (for dumps, logging and the workers)."""
    return {KEY_OF_FIELD.get(k, k): v for k, v in dataclasses.asdict(cfg).items()}
