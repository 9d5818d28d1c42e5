"""Build the BM25 index of the `search` tool over a passage file (jsonl: {"id", "title", "text"}).

    python examples/hotpotqa/build_index.py --passages data/hotpotqa/passages.jsonl --out data/hotpotqa/index

The passages default to HotpotQA's context paragraphs (written by convert.py --passages); any
corpus in the same format works (e.g. a Wikipedia dump split into paragraphs). Then set
`tools.search_index_dir` to the --out folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_agent.envs.tools.search import build_search_index, read_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", required=True, type=Path, help="passage jsonl file")
    parser.add_argument("--out", required=True, type=Path, help="index folder to write")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = build_search_index(args.passages, args.out)
    num = len(read_corpus(out / "passages.jsonl"))
    print(f"indexed {num} passages in {time.perf_counter() - start:.1f}s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
