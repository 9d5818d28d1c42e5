"""`data.tokenizer.load_tokenizer`: AutoTokenizer's choice of class, recorded once, builds the same
tokenizer without transformers' model registry (checked in fresh processes)."""

from __future__ import annotations

import json

import pytest

from megatron_agent.data.tokenizer import folder_key, load_tokenizer
from megatron_agent.platform.user_cache import CACHE_ENV, cache_dir
from tests.conftest import fresh_python

MESSAGES = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 17 * 23?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expr": "17*23"}}</tool_call>',
    },
    {"role": "tool", "content": "391"},
]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
TEXT = "12 + 7 = 19\n<|im_start|>user <tool_call>x</tool_call><|im_end|> naïve  spaces\n\n"

# A fresh process: load, report what the tokenizer does and which heavy modules were imported.
PROBE = """
import json, sys
from megatron_agent.data.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1])
messages, tools, text = json.loads(sys.argv[2])
print(json.dumps({"outputs": %s, "registry": "transformers.models.auto" in sys.modules,
                  "dynamo": "torch._dynamo" in sys.modules}))
"""
OUTPUTS = (
    "[type(tok).__module__ + '.' + type(tok).__qualname__, len(tok), tok.eos_token_id, tok.pad_token_id,"
    " tok.encode(text, add_special_tokens=False), tok.decode(tok.encode(text)),"
    " tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False),"
    " tok.convert_ids_to_tokens(list(range(20)))]"
)


def outputs_of(tok, messages=MESSAGES, tools=TOOLS, text=TEXT) -> list:
    """What the probe prints, computed in this process (JSON-normalised)."""
    return json.loads(json.dumps(eval(OUTPUTS)))  # noqa: S307 -- the test's own expression


def probe(folder, cache) -> dict:
    """`load_tokenizer(folder)` in a fresh process with the cache at `cache`."""
    return fresh_python(
        PROBE % OUTPUTS, folder, json.dumps([MESSAGES, TOOLS, TEXT]), env={CACHE_ENV: str(cache)}, timeout=120
    )


@pytest.fixture(scope="module")
def folders(tiny_models, tmp_path_factory) -> dict:
    """The quickstart's tokenizer (a llama folder naming TokenizersBackend) and the tiny qwen2 one
    (which AutoTokenizer builds as Qwen2Tokenizer, whatever its folder names)."""
    from megatron_agent.models.tiny import make_quickstart_model

    return {
        "quickstart": make_quickstart_model(tmp_path_factory.mktemp("quickstart")),
        "qwen2": tiny_models["qwen2"],
    }


@pytest.mark.parametrize("name", ["quickstart", "qwen2"])
def test_the_recorded_class_builds_autotokenizers_tokenizer_without_the_model_registry(
    folders, name, tmp_path
):
    from transformers import AutoTokenizer

    folder = folders[name]
    expected = outputs_of(AutoTokenizer.from_pretrained(str(folder)))
    first = probe(folder, tmp_path)  # not recorded yet: AutoTokenizer, then its choice recorded
    assert first["registry"] and first["outputs"] == expected
    second = probe(folder, tmp_path)
    assert not second["registry"] and not second["dynamo"], "the recorded class still imported the registry"
    assert second["outputs"] == expected  # the same class, vocabulary, ids, template and decoding
    assert (
        expected[0]
        == {
            "quickstart": "transformers.tokenization_utils_tokenizers.TokenizersBackend",
            "qwen2": "transformers.models.qwen2.tokenization_qwen2.Qwen2Tokenizer",
        }[name]
    )


def test_a_changed_folder_is_not_served_from_the_record(folders, tmp_path, monkeypatch):
    """The key covers the configs' bytes and the file names: an edit means AutoTokenizer again."""
    import shutil

    from megatron_agent.data.tokenizer import _recorded_class

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder = shutil.copytree(folders["qwen2"], tmp_path / "qwen2")
    load_tokenizer(folder)
    key = folder_key(folder)
    assert _recorded_class(key).__name__ == "Qwen2Tokenizer"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
    edited = folder_key(folder)
    (folder / "extra.txt").write_text("x")
    added = folder_key(folder)
    assert (
        len({key, edited, added}) == 3 and _recorded_class(edited) is None and _recorded_class(added) is None
    )
    load_tokenizer(folder)  # recorded again for the folder as it is now, the old entry kept
    assert _recorded_class(added).__name__ == "Qwen2Tokenizer" and _recorded_class(key) is not None


def test_remote_code_and_unreadable_caches_fall_back_to_autotokenizer(folders, tmp_path, monkeypatch):
    import shutil

    folder = shutil.copytree(folders["quickstart"], tmp_path / "remote")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "auto_map": {"AutoTokenizer": [None, "x.Y"]}})
    )
    assert folder_key(folder) is None  # remote code: never recorded
    assert folder_key(tmp_path / "absent") is None

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    cache_dir().mkdir()
    (cache_dir() / "tokenizer_classes.json").write_text("{not json")
    expected = outputs_of(load_tokenizer(folders["quickstart"]))  # a corrupt cache: AutoTokenizer
    recorded = json.loads((cache_dir() / "tokenizer_classes.json").read_text())
    assert list(recorded.values()) == ["transformers.tokenization_utils_tokenizers:TokenizersBackend"]
    # a recorded class that no longer imports is ignored, not trusted
    key = folder_key(folders["quickstart"])
    (cache_dir() / "tokenizer_classes.json").write_text(json.dumps({key: "transformers.gone:Nothing"}))
    assert outputs_of(load_tokenizer(folders["quickstart"])) == expected


def test_absolute_paths_share_a_record_and_no_hub_pattern_can_match_one(folders, tmp_path, monkeypatch):
    """AutoTokenizer matches the path against hub-id patterns ("org/name-*"); the key leaves out an
    absolute path, which is right only while no pattern can match one."""
    import shutil

    from transformers.models.auto import tokenization_auto

    copy = shutil.copytree(folders["qwen2"], tmp_path / "elsewhere" / "qwen2")
    assert folder_key(copy) == folder_key(folders["qwen2"])
    monkeypatch.chdir(tmp_path)
    assert folder_key("elsewhere/qwen2") not in (None, folder_key(copy))
    patterns = tokenization_auto.MODEL_IDS_TO_TOKENIZERS_BACKEND
    assert patterns and all(p[0] not in "/*?[" for p in patterns), patterns
