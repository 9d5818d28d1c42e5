"""`platform.user_cache`: its JSON files are written whole, read back, and a file that cannot be
read or written is reported as absent, never half-written."""

from __future__ import annotations

import pytest

from megatron_agent.platform.user_cache import read_json, write_json


def test_a_json_file_is_written_whole_and_read_back(tmp_path):
    path = tmp_path / "made" / "here" / "entries.json"  # the folders are made
    assert write_json(path, {"a": [1, 2]}, indent=0)
    assert read_json(path) == {"a": [1, 2]} and path.read_text().startswith("{\n")
    assert write_json(path, ["replaced"]) and read_json(path) == ["replaced"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["entries.json"]  # no staging file left


def test_what_cannot_be_read_or_written_is_absent_and_leaves_nothing(tmp_path):
    assert read_json(tmp_path / "missing.json") is None
    (tmp_path / "broken.json").write_text('{"half": ')
    assert read_json(tmp_path / "broken.json") is None
    (tmp_path / "a_file").write_text("not a folder")
    assert write_json(tmp_path / "a_file" / "entries.json", {"a": 1}) is False
    # a value JSON cannot hold is the caller's error, and the old file stays whole
    assert write_json(tmp_path / "kept.json", {"a": 1})
    with pytest.raises(TypeError):
        write_json(tmp_path / "kept.json", {"a": object()})
    assert read_json(tmp_path / "kept.json") == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "broken.json", "kept.json"]
