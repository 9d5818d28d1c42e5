"""`train.tiny_cache`: the run's tiny base model, made once and copied from
the per-user cache after that, byte for byte what `models.tiny` makes in place."""

from __future__ import annotations

import filecmp

import pytest

from megatron_agent.models.tiny import make_tiny_model
from megatron_agent.platform.user_cache import CACHE_ENV
from megatron_agent.train import tiny_cache


def same_files(a, b) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


def test_made_once_then_copied_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = tiny_cache.make_tiny_base_model("qwen2", 3, tmp_path / "run1" / "base_model")
    cached = list((tmp_path / "cache" / "tiny_models").iterdir())
    assert [p.name for p in cached] == [tiny_cache.tiny_model_key("qwen2", 3)]

    def not_again(*args):
        raise AssertionError("made again instead of copied")

    monkeypatch.setattr(tiny_cache, "_make", not_again)
    second = tiny_cache.make_tiny_base_model("qwen2", 3, tmp_path / "run2" / "base_model")
    in_place = make_tiny_model(tmp_path / "in_place", "qwen2", seed=3)
    assert same_files(first, second) and same_files(first, in_place)
    assert tiny_cache.tiny_model_key("qwen2", 4) != tiny_cache.tiny_model_key("qwen2", 3)
    assert tiny_cache.tiny_model_key("llama", 3) != tiny_cache.tiny_model_key("qwen2", 3)


def test_a_failed_make_leaves_nothing_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="nope"):
        tiny_cache.make_tiny_base_model("nope", 0, tmp_path / "base_model")
    assert list((tmp_path / "cache" / "tiny_models").iterdir()) == []


def test_an_unwritable_cache_makes_the_model_in_place(tmp_path, monkeypatch):
    (tmp_path / "not_a_folder").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "not_a_folder"))
    out = tiny_cache.make_tiny_base_model("qwen2", 3, tmp_path / "base_model")
    assert same_files(out, make_tiny_model(tmp_path / "in_place", "qwen2", seed=3))


def test_only_the_most_recently_used_models_and_no_stale_makes_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    models = tmp_path / "cache" / "tiny_models"
    models.mkdir(parents=True)
    for i in range(tiny_cache._KEEP + 2):  # stand-ins, oldest first
        (models / f"old{i}").mkdir()
        (models / f"old{i}" / "config.json").write_text("{}")
        tiny_cache.os.utime(models / f"old{i}", (i, i))
    (models / ".making.killed").mkdir()  # what a killed make left, two hours ago
    tiny_cache.os.utime(models / ".making.killed", (0, 0))
    (models / ".making.now").mkdir()  # another run's make in progress
    monkeypatch.setattr(tiny_cache, "tiny_model_key", lambda family, seed: "old1")
    tiny_cache.make_tiny_base_model("qwen2", 0, tmp_path / "base_model")  # uses old1: now the newest
    kept = sorted(p.name for p in models.iterdir() if not p.name.startswith("."))
    assert len(kept) == tiny_cache._KEEP and "old1" in kept and "old0" not in kept and "old2" not in kept
    assert sorted(p.name for p in models.iterdir() if p.name.startswith(".")) == [".making.now"]
