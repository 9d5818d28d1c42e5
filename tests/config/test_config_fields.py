"""Every config field is read: a field that nothing reads fails this test by name.

For each leaf field `section.name` of the schema, some module of megatron_agent (outside the
schema and the validation pass, where reading a value only checks it) must read `<section>.name`: through the section itself (`cfg.rollout.temperature`), a
local alias of it (`r = cfg.rollout`; `a, d = cfg.actor, cfg.data`), or a parameter that holds it
(named like the section, or annotated with its class). The check reads the source (AST), so it
also covers code that runs only in Ray workers or on a GPU. That each value read takes effect is
checked by `test_config_effects.py`: every field set to another valid value must change what the
run builds or does (or be on its GPU_ONLY list).
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from megatron_agent.config import Config

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_agent"
SCHEMA = PACKAGE / "config" / "schema.py"
VALIDATE = PACKAGE / "config" / "validate.py"  # checking a value is not using it

# Fields read only where this test cannot see a section access (e.g. a section handed on whole
# and read by another name). Keep it short and say why; it is empty today.
NOT_SEEN: set[str] = set()


def leaf_fields(cls=Config, prefix=()) -> list[tuple[tuple[str, ...], str, type]]:
    """(section path, field name, section class) of every leaf field."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out += leaf_fields(typ, (*prefix, f.name))
        else:
            out.append((prefix, f.name, cls))
    return out


SECTIONS = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
SECTION_OF_CLASS = {cls.__name__: name for name, cls in SECTIONS.items()} | {"PythonToolConfig": "python"}
SECTION_NAMES = set(SECTIONS) | {"python"}


def _section(expr: ast.AST, aliases: dict[str, str], self_aliases: dict[str, str]) -> str | None:
    """The config section `expr` evaluates to, when it visibly is one."""
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id)
    if isinstance(expr, ast.IfExp):
        return _section(expr.body, aliases, self_aliases)
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and expr.value.id == "self" and expr.attr in self_aliases:
            return self_aliases[expr.attr]
        if expr.attr in SECTION_NAMES:
            return expr.attr
    return None


def _aliases(func: ast.AST, self_aliases: dict[str, str]) -> dict[str, str]:
    """Local names bound to a section: parameters (by name or annotation) and assignments."""
    aliases: dict[str, str] = {}
    if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for arg in [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]:
            ann = ast.unparse(arg.annotation) if arg.annotation else ""
            if arg.arg in SECTION_NAMES:
                aliases[arg.arg] = arg.arg
            for cls, section in SECTION_OF_CLASS.items():
                if cls in ann:
                    aliases[arg.arg] = section
    for _ in range(2):  # an alias of an alias
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                pairs = [(target, value)]
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                    pairs = list(zip(target.elts, value.elts))
                for t, v in pairs:
                    section = _section(v, aliases, self_aliases)
                    if isinstance(t, ast.Name) and section:
                        aliases[t.id] = section
    return aliases


def _functions(node: ast.AST):
    return [n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _self_aliases(cls: ast.ClassDef) -> dict[str, str]:
    """`self.X = <a section>` anywhere in the class's methods."""
    out: dict[str, str] = {}
    for func in _functions(cls):
        aliases = _aliases(func, out)
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        section = _section(node.value, aliases, out)
                        if section:
                            out[target.attr] = section
    return out


def reads(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """(section name, field name) pairs read anywhere in `package` outside the schema and the
    validation pass."""
    found = set()
    for path in package.rglob("*.py"):
        if path in (SCHEMA, VALIDATE):
            continue
        tree = ast.parse(path.read_text())
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        owner = {id(f): _self_aliases(c) for c in classes for f in _functions(c)}
        for scope in [tree, *_functions(tree)]:
            self_aliases = owner.get(id(scope), {})
            aliases = _aliases(scope, self_aliases)
            for node in ast.walk(scope):
                if isinstance(node, ast.Attribute):
                    section = _section(node.value, aliases, self_aliases)
                    if section:
                        found.add((section, node.attr))
    return found


def test_every_config_field_is_read_somewhere():
    seen = reads()
    unread = []
    for path, name, _cls in leaf_fields():
        dotted = ".".join((*path, name))
        if dotted in NOT_SEEN:
            continue
        if (path[-1], name) not in seen:
            unread.append(dotted)
    assert not unread, (
        f"config fields that nothing reads (read them where their docstring says, or remove them): {unread}"
    )


def test_the_check_sees_reads_through_aliases_and_misses_unread_fields(tmp_path):
    # The check must be able to fail: on a package that reads two fields, only those are found.
    (tmp_path / "mod.py").write_text(
        "from megatron_agent.config import SyncConfig\n"
        "def f(cfg):\n    r = cfg.rollout\n    return r.temperature\n"
        "class Sender:\n"
        "    def __init__(self, cfg: SyncConfig):\n        self.c = cfg\n"
        "    def size(self):\n        return self.c.bucket_mb\n"
    )
    found = reads(tmp_path)
    assert {("rollout", "temperature"), ("sync", "bucket_mb")} <= found
    assert ("rollout", "top_p") not in found and ("sync", "verify") not in found
