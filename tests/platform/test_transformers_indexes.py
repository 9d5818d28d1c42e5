"""`platform.transformers_indexes`: transformers' import-time indexes answered from the per-user
cache are the indexes transformers computes, and a changed input, a bad file or the off switch
computes them again."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import types
from pathlib import Path

from megatron_agent.platform import transformers_indexes as ti

# What a process's transformers looks like: the distributions of every package, and the lazy
# modules' maps (name -> module, module names, missing backends) of the package and of `models`.
PROBE = r"""
import json, sys
import megatron_agent
from megatron_agent.platform import transformers_indexes as ti
import transformers, transformers.models
from transformers.utils import import_utils
def lazy(m):
    return {"classes": sorted(m._class_to_module.items()), "modules": sorted(m._modules),
            "missing": sorted((k, sorted(v)) for k, v in m._object_missing_backend.items()),
            "names": sorted(dir(m))}
print(json.dumps({
    "hits": ti.hits,
    "hook": type(import_utils.define_import_structure).__name__,
    "distributions": sorted((k, v) for k, v in import_utils.PACKAGE_DISTRIBUTION_MAPPING.items()),
    "transformers": lazy(transformers), "models": lazy(transformers.models),
    "tokenizer": transformers.PreTrainedTokenizerFast.__module__,
}))
"""


def probe(cache: Path, off: bool = False) -> dict:
    env = dict(os.environ, MEGATRON_AGENT_CACHE=str(cache))
    env.pop(ti.OFF_ENV, None)
    if off:
        env[ti.OFF_ENV] = "0"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_that_reads_the_cache_builds_the_same_transformers(tmp_path):
    computed = probe(tmp_path / "off", off=True)
    filled = probe(tmp_path / "cache")
    read = probe(tmp_path / "cache")
    assert computed["hits"] == [] and filled["hits"] == []
    assert sorted(read["hits"]) == ["distributions", "structure", "structure"]  # transformers, then .models
    assert len(list((tmp_path / "cache" / "transformers_indexes").glob("*.json"))) == 3
    assert not (tmp_path / "off").exists()
    for got in (filled, read):
        for part in ("distributions", "transformers", "models", "tokenizer"):
            assert got[part] == computed[part], part
    assert computed["distributions"] and len(computed["transformers"]["classes"]) > 1000


def fake_transformers(root: Path, calls: list) -> tuple[types.ModuleType, Path]:
    """A module like transformers.utils.import_utils in root/utils, beside a `models` folder."""
    (root / "utils").mkdir(parents=True)
    (root / "utils" / "import_utils.py").write_text("# the parser\n")
    models = root / "models"
    for name in ("llama", "qwen2"):
        (models / name).mkdir(parents=True)
    (models / "__init__.py").write_text("")

    def define_import_structure(module_path, prefix=None):
        calls.append((str(module_path), prefix))
        names = sorted(p.name for p in models.iterdir() if p.is_dir())
        return {
            frozenset(): {f"{prefix or ''}{n}.configuration": {f"{n}Config"} for n in names},
            frozenset({"torch"}): {"llama.modeling": {"LlamaModel", "LlamaForCausalLM"}},
        }

    module = types.ModuleType("fake_import_utils")
    module.__file__ = str(root / "utils" / "import_utils.py")
    module.define_import_structure = define_import_structure
    return module, models


def cached_define(module: types.ModuleType, original):
    """What a fresh process's hook makes of `module` (its own in-memory cache empty)."""
    module.define_import_structure = original
    ti._cache_import_structure(module)
    return module.define_import_structure


def test_the_import_structure_is_read_back_until_the_models_folder_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_AGENT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ti, "hits", [])
    calls: list = []
    module, models = fake_transformers(tmp_path / "tf", calls)
    original = module.define_import_structure
    first = cached_define(module, original)(models, prefix="models.")
    assert len(calls) == 1 and ti.hits == []
    again = cached_define(module, original)(models, prefix="models.")
    assert again == first and len(calls) == 1 and ti.hits == ["structure"]
    # the file argument (models/__init__.py) is a call of its own
    from_file = cached_define(module, original)(str(models / "__init__.py"))
    assert len(calls) == 2 and from_file != first
    # a new model folder: computed again, and it is in the answer
    (models / "mistral").mkdir()
    changed = cached_define(module, original)(models, prefix="models.")
    assert len(calls) == 3 and "models.mistral.configuration" in changed[frozenset()]
    # another folder is not cached at all
    cached_define(module, original)(models / "llama")
    cached_define(module, original)(models / "llama")
    assert len(calls) == 5


def test_a_bad_cache_file_is_computed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_AGENT_CACHE", str(tmp_path / "cache"))
    calls: list = []
    module, models = fake_transformers(tmp_path / "tf", calls)
    original = module.define_import_structure
    expected = cached_define(module, original)(models)
    (file,) = (tmp_path / "cache" / "transformers_indexes").glob("*.json")
    for bad in ("not json", "[[1, {}]]", '[[["torch"], {"m": "names"}]]', '{"a": 1}'):
        file.write_text(bad)
        assert cached_define(module, original)(models) == expected
    assert len(calls) == 5


def test_the_distributions_are_read_back_until_a_path_folder_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_AGENT_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    calls = []

    def packages_distributions():
        calls.append(1)
        return {"numpy": ["numpy"], "yaml": ["PyYAML"]}

    monkeypatch.setattr(importlib.metadata, "packages_distributions", packages_distributions)
    for _ in range(2):
        with ti._cached_packages_distributions():
            assert importlib.metadata.packages_distributions() == {"numpy": ["numpy"], "yaml": ["PyYAML"]}
        assert importlib.metadata.packages_distributions is packages_distributions  # restored
    assert len(calls) == 1
    # '' in sys.path is the current folder: another current folder is another key, even with the
    # same modification time
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    for name in ("here", "there"):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, ns=(0, 10**18))
        monkeypatch.chdir(tmp_path / name)
        with ti._cached_packages_distributions():
            importlib.metadata.packages_distributions()
    assert len(calls) == 3
    (site / "new_package-1.0.dist-info").mkdir()  # an install
    os.utime(site, ns=(0, os.stat(site).st_mtime_ns + 1))  # whatever the clock's resolution
    with ti._cached_packages_distributions():
        importlib.metadata.packages_distributions()
    assert len(calls) == 4


def test_install_does_nothing_when_off_or_too_late(monkeypatch):
    monkeypatch.setenv(ti.OFF_ENV, "0")
    assert ti.install() is False
    monkeypatch.delenv(ti.OFF_ENV)
    monkeypatch.setitem(sys.modules, ti.TARGET, types.ModuleType(ti.TARGET))
    assert ti.install() is False


def test_the_cache_keeps_the_newest_files(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_AGENT_CACHE", str(tmp_path))
    monkeypatch.setattr(ti, "_MAX_FILES", 2)
    for i in range(4):
        ti._write(f"key{i}", {"i": [str(i)]})
        os.utime(tmp_path / ti._FOLDER / f"key{i}.json", ns=(0, 10**18 + i))
    assert sorted(p.name for p in (tmp_path / ti._FOLDER).glob("*.json")) == ["key2.json", "key3.json"]
    assert ti._read("key3") == {"i": ["3"]} and ti._read("key0") is None
