"""The layers contract of megatron_agent: no module imports from a higher layer.

LAYERS lists megatron_agent's top-level packages and modules from top to bottom. A module may
import from its own package and from any lower layer. Packages that share a layer are
independent: they import neither each other nor anything above them. Every import statement
counts, at module level or inside a function, absolute or relative. Imports by name at run time
(`importlib.import_module`, dotted paths in the config) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path

LAYERS: list[tuple[str, ...]] = [
    # `python -m megatron_agent`: dispatches to a command by name
    ("__main__",),
    # the command-line commands: train, sft, score, rollout
    ("commands",),
    # the Ray trainer: RL loop, workers, actor update, SFT loop, run logs and state
    ("train",),
    # Megatron -> engine weight sync; distributed checkpoints; the actor/reference loaded from HF
    ("sync", "checkpoint", "build_policy"),
    # the vLLM engine, agent loop, trajectories, dumps and the engine's quantized folder
    ("rollout",),
    # weight quantization (ModelOpt formats), QAT wrappers, quantized HF folders for vLLM
    ("quant",),
    # the HF <-> Megatron mapping table, safetensors reading, loading, export and folder writes
    ("weights",),
    # GPT build from HF configs, log-probs, forward/backward, MegatronModel, tiny models
    ("models",),
    # tasks, SFT chat data, the resumable prompt sampler
    ("data",),
    # tools and rewards
    ("envs",),
    # RL math (advantages, KL, losses); the config tree; device and parallel setup
    ("rl", "config", "platform"),
    # the two kinds of expected error (bad input, run failure) and the commands' error handler;
    # a package's names exported from their modules on first use
    ("errors", "lazy_exports"),
]

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "megatron_agent"


def top_level_names(root: Path) -> set[str]:
    """The top-level subpackages and modules of the package at `root` (its `__init__` excluded)."""
    names = set()
    for path in root.iterdir():
        if path.is_dir() and any(path.rglob("*.py")):
            names.add(path.name)
        elif path.suffix == ".py" and path.name != "__init__.py":
            names.add(path.stem)
    return names


def imports_of(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every import in `path`, relative imports resolved against `root`."""
    package = list(path.relative_to(root.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == root.name:  # `from megatron_agent import config` imports a submodule
                for alias in node.names:
                    yield node.lineno, f"{module}.{alias.name}"
            else:
                yield node.lineno, module


def layer_violations(root: Path, layers: Sequence[tuple[str, ...]]) -> list[str]:
    """`file:line imports pkg (layer i) from a lower layer j (src)` for each import against `layers`."""
    layer_of = {name: i for i, layer in enumerate(layers) for name in layer}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for line, module in sorted(imports_of(path, root)):
            parts = module.split(".")
            if parts[0] != root.name or len(parts) < 2 or parts[1] == src:
                continue
            dst = parts[1]
            if src not in layer_of or dst not in layer_of:
                continue  # test_every_package_has_a_layer names it
            i, j = layer_of[dst], layer_of[src]
            where = f"{root.name}/{rel.as_posix()}:{line}"
            if i < j:
                found.append(f"{where} imports {dst} (layer {i}) from a lower layer {j} ({src})")
            elif i == j:
                found.append(f"{where} imports {dst} from {src}, its sibling in layer {i}")
    return found


def test_every_package_has_a_layer():
    placed = [name for layer in LAYERS for name in layer]
    assert len(placed) == len(set(placed)), f"placed twice in LAYERS: {placed}"
    names = top_level_names(PACKAGE_DIR)
    assert not names - set(placed), f"give these a layer in LAYERS: {sorted(names - set(placed))}"
    assert not set(placed) - names, f"LAYERS names what does not exist: {sorted(set(placed) - names)}"


def test_no_import_from_a_higher_layer():
    violations = layer_violations(PACKAGE_DIR, LAYERS)
    assert not violations, "imports against LAYERS:\n" + "\n".join(violations)


def test_the_check_sees_nested_relative_and_sibling_imports(tmp_path):
    root = tmp_path / "pkg"
    for folder in ("high", "low", "side"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "high" / "a.py").write_text("from pkg.low import b\n")
    (root / "low" / "b.py").write_text("def f():\n    from ..high import a\n\n\nimport pkg.side.c\n")
    (root / "side" / "c.py").write_text("from pkg import low\n")
    (root / "tool.py").write_text("import pkg.high.a\n")
    layers = [("tool",), ("high",), ("low", "side")]
    assert layer_violations(root, layers) == [
        "pkg/low/b.py:2 imports high (layer 1) from a lower layer 2 (low)",
        "pkg/low/b.py:5 imports side from low, its sibling in layer 2",
        "pkg/side/c.py:1 imports low from side, its sibling in layer 2",
    ]
    assert top_level_names(root) == {"high", "low", "side", "tool"}
