"""A search tool over a local passage corpus (BM25), and a synthetic corpus for the CPU recipe.

:class:`BM25Search` is the retrieval tool of the search agent (the AstraFlow paper's ASearcher
analogue): a callable class named in a workflow's ``tools`` list, e.g.::

    tools:
      - class_path: astralight.agents.search.BM25Search
        init_args: {corpus: data/wiki/passages.jsonl, k: 3, max_chars: 400}

The corpus is a JSONL file (or JSON / Parquet, read by :mod:`astralight.tasks.data.readers`)
of passages ``{"id", "title", "text"}``; the BM25 index is built once, when the tool is
constructed (the RaaS builds its workflow at start-up, so a bad corpus fails there and not in
the middle of a run), with `bm25s <https://github.com/xhluna/bm25s>`_ (sparse scores, numpy
backend; the passages are held in memory, which suits corpora up to a few million passages). A
call tokenizes the query with the index's own vocabulary and returns the top ``k`` passages as
short text. Queries never change the index, so
concurrent calls from the RaaS's executor threads are safe.

:func:`synthetic_qa` / :func:`write_synthetic_qa` make the CPU recipe's world: fictional people
with fictional birthplaces, jobs and pets (one passage per fact), and questions about them.
Train and eval questions are about disjoint people and the facts are drawn at random, so a model
can answer an eval question only by searching for it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

__all__ = ["BM25Search", "read_corpus", "person_name", "synthetic_qa", "write_synthetic_qa",
           "RELATIONS"]


def _import_bm25s():
    """``bm25s``, imported without numba.

    Why: bm25s imports numba whenever it is installed (for its optional numba backend, which
    this tool does not use: the numpy backend is the default), and llvmlite, loaded with numba,
    holds an object that breaks vLLM's start-up scan of every loaded module
    (``vllm/triton_utils/dispatcher.py``: ``'_lib_fn_wrapper' object has no attribute 'get'``),
    so a RaaS that builds this tool before its engine would fail to start. Hiding numba from
    this one import (``sys.modules["numba"] = None`` makes ``import numba`` fail) keeps it out.
    """
    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # type: ignore[assignment]
    try:
        import bm25s
    finally:
        del sys.modules["numba"]
    return bm25s


def read_corpus(path: str | os.PathLike) -> list[dict]:
    """The passages of a corpus file as ``{"id", "title", "text"}`` dicts.

    ``text`` is required (a non-empty string); ``title`` defaults to ``""`` and ``id`` to the
    row number. Errors name the ``corpus`` argument and say what the file must hold.
    """
    from astralight.tasks.data.readers import read_records

    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.exists():
        raise FileNotFoundError(f"corpus: {os.fspath(path)!r} does not exist; give a local JSONL "
                                'file with one {"id", "title", "text"} passage per line')
    records, _ = read_records(str(p), columns={"id", "title", "text"})
    if not records:
        raise ValueError(f"corpus: {p} holds no passage; it needs one "
                         '{"id", "title", "text"} object per line')
    passages = []
    for row, rec in enumerate(records):
        text = rec.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"corpus: row {row} of {p} has no 'text' (a non-empty string); "
                             f"its fields are {sorted(rec)}")
        title = rec.get("title")
        passages.append({"id": str(rec["id"]) if rec.get("id") is not None else str(row),
                         "title": "" if title is None else str(title), "text": text})
    return passages


class BM25Search:
    """Search a local corpus with BM25; an instance is the tool (called with ``query``).

    Args:
        corpus: the passage file (JSONL of ``{"id", "title", "text"}``; JSON / Parquet too).
        k: passages returned per query (at most the corpus size).
        max_chars: a passage's text is cut to this many characters (and ends in ``...``).
        show_title: prefix each passage with its title (``(1) Title: text``).
        stopwords: bm25s stopword list (``"en"``, a list of words, or None for none).
        name: the name the model calls the tool by (the Tool's default name).
        min_score: the relevance threshold: a passage scoring at most this is not returned, and
            a query with none above it gets ``no results``. 0 returns any passage sharing a
            word with the query. A threshold keeps a query that matches only common words (a
            misspelt name beside "born") from returning whichever passage ranks first for
            them, which an exact-match reward then pays whenever that passage's value happens
            to be the right one: RL learns to guess through the tool instead of to search.
    """

    def __init__(self, corpus: str, k: int = 3, max_chars: int = 300, show_title: bool = True,
                 stopwords: str | list[str] | None = "en", name: str = "search",
                 min_score: float = 0.0):
        if k < 1:
            raise ValueError(f"k: must be >= 1 passage, got {k}")
        if max_chars < 1:
            raise ValueError(f"max_chars: must be >= 1, got {max_chars}")
        if not min_score >= 0:
            raise ValueError(f"min_score: must be a BM25 score >= 0, got {min_score}")
        bm25s = _import_bm25s()
        from bm25s.tokenization import Tokenizer

        self.corpus_path, self.k, self.max_chars = str(corpus), int(k), int(max_chars)
        self.show_title, self.min_score = bool(show_title), float(min_score)
        self.__name__ = name  # what astralight.agents.tools.Tool names the tool by default
        self.passages = read_corpus(corpus)
        self.tokenizer = Tokenizer(lower=True, stopwords=stopwords)
        ids = self.tokenizer.tokenize([f"{p['title']}\n{p['text']}" for p in self.passages],
                                      return_as="ids", show_progress=False)
        self.retriever = bm25s.BM25()
        self.retriever.index(ids, show_progress=False)

    def __len__(self) -> int:
        return len(self.passages)

    def retrieve(self, query: str, k: int | None = None) -> list[tuple[dict, float]]:
        """``(passage, score)`` of the best ``k`` passages scoring above ``min_score``, best
        first."""
        k = min(int(k or self.k), len(self.passages))
        ids = self.tokenizer.tokenize([str(query)], update_vocab=False, return_as="ids",
                                      show_progress=False)
        docs, scores = self.retriever.retrieve(ids, k=k, show_progress=False, n_threads=0)
        return [(self.passages[int(d)], float(s)) for d, s in zip(docs[0], scores[0])
                if s > self.min_score]

    def format(self, hits: list[tuple[dict, float]]) -> str:
        """Hits as the model reads them: ``(1) Title: text`` lines."""
        lines = []
        for i, (p, _) in enumerate(hits, 1):
            text = p["text"].strip()
            if len(text) > self.max_chars:
                text = text[: self.max_chars].rstrip() + "..."
            head = f"{p['title']}: " if self.show_title and p["title"] else ""
            lines.append(f"({i}) {head}{text}")
        return "\n".join(lines)

    def search(self, query: str) -> str:
        """The top passages for ``query`` as text (``no results`` when nothing matches)."""
        if not str(query).strip():
            return "no results: the query is empty"
        hits = self.retrieve(query)
        return self.format(hits) if hits else f"no results for {str(query).strip()!r}"

    def __call__(self, query: str) -> str:
        """Search the knowledge base and return the most relevant passages.

        Args:
            query: what to look for, e.g. a name or a question
        """
        return self.search(query)


# ---------------------------------------------------------------------------- synthetic world

#: ``(relation, passage template, question template, values)``: the question shares a keyword
#: with its passage (born / job / pet), so BM25 on the question ranks the right fact first
RELATIONS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("born", "{name} was born in {value}.", "Where was {name} born?", ()),  # cities: generated
    ("job", "The job of {name} is {value}.", "What is the job of {name}?",
     ("baker", "pilot", "farmer", "painter", "doctor", "sailor", "singer", "tailor", "miner",
      "judge", "nurse", "potter", "writer", "hunter", "barber", "cook")),
    ("pet", "The pet of {name} is a {value}.", "What pet does {name} have?",
     ("cat", "dog", "goat", "owl", "fox", "horse", "rabbit", "parrot", "turtle", "snake",
      "frog", "mouse", "duck", "pony", "lizard", "crow")),
]
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kr", "st", "tr", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io")
_CODAS = ("", "", "n", "r", "l", "s", "x", "k")


def _word(rng: np.random.Generator, syllables: int) -> str:
    parts = [str(rng.choice(_ONSETS)) + str(rng.choice(_VOWELS)) for _ in range(syllables)]
    return ("".join(parts) + str(rng.choice(_CODAS))).capitalize()


def person_name(rng: np.random.Generator) -> str:
    """A made-up one-word name of the synthetic world's kind (two syllables and a coda, e.g.
    ``Drakeal``): what :func:`synthetic_qa` names its people with."""
    return _word(rng, 2)


def _distinct(rng: np.random.Generator, count: int, make, taken: set[str]) -> list[str]:
    out = []
    while len(out) < count:
        w = make()
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def synthetic_qa(seed: int = 0, n_people: int = 200, eval_share: float = 0.2,
                 n_cities: int = 24, relations: list[str] | None = None
                 ) -> tuple[list[dict], list[dict], list[dict]]:
    """A fictional world: ``(corpus, train, eval)``, deterministic from ``seed``.

    Every person gets one value per relation (drawn at random), one passage per fact, and one
    question per fact. ``eval_share`` of the people (a seeded choice) are asked about only in
    ``eval``: their facts are in the corpus but in no train question. Rows: corpus ``{"id",
    "title", "text"}``; questions ``{"id", "question", "answer", "relation", "title"}`` (the
    title of the passage that answers it).
    """
    if n_people < 2:
        raise ValueError(f"n_people: need at least 2, got {n_people}")
    if not 0.0 < eval_share < 1.0:
        raise ValueError(f"eval_share: must be in (0, 1), got {eval_share}")
    known = [r[0] for r in RELATIONS]
    wanted = list(relations or known)
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise ValueError(f"relations: unknown {unknown}; known: {known}")
    rng = np.random.default_rng([seed, 7])
    taken: set[str] = set()
    # one short word each: a character-level model copies the name into its query
    people = _distinct(rng, n_people, lambda: person_name(rng), taken)
    cities = _distinct(rng, n_cities, lambda: _word(rng, int(rng.integers(2, 4))), taken)
    n_eval = max(1, int(round(eval_share * n_people)))
    held_out = set(int(i) for i in rng.permutation(n_people)[:n_eval])
    corpus, train, evals = [], [], []
    for i, name in enumerate(people):
        for rel, passage, question, values in RELATIONS:
            if rel not in wanted:
                continue
            value = str(rng.choice(values or cities))
            pid = f"p{i}-{rel}"
            corpus.append({"id": pid, "title": name,
                           "text": passage.format(name=name, value=value)})
            row = {"id": f"q{i}-{rel}", "question": question.format(name=name), "answer": value,
                   "relation": rel, "title": name}
            (evals if i in held_out else train).append(row)
    order = rng.permutation(len(corpus))  # passages of one person are not adjacent in the file
    return [corpus[int(j)] for j in order], train, evals


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def write_synthetic_qa(out_dir: str | os.PathLike, seed: int = 0, n_people: int = 200,
                       eval_share: float = 0.2, n_cities: int = 24,
                       relations: list[str] | None = None) -> dict[str, str]:
    """Write :func:`synthetic_qa`'s world to ``out_dir``: ``corpus.jsonl``, ``train.jsonl``
    (HotpotQA format: ``_id``, ``question``, ``answer``, ``type``, ``level``,
    ``supporting_facts``) and ``eval.jsonl`` (Bamboogle format: ``Question``, ``Answer``), so
    the recipe reads both formats of :class:`~astralight.tasks.qa.QASource`. Returns the paths
    by name (``corpus``, ``train``, ``eval``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus, train, evals = synthetic_qa(seed, n_people, eval_share, n_cities, relations)
    paths = {"corpus": out / "corpus.jsonl", "train": out / "train.jsonl",
             "eval": out / "eval.jsonl"}
    _write_jsonl(paths["corpus"], corpus)
    _write_jsonl(paths["train"], [
        {"_id": q["id"], "question": q["question"], "answer": q["answer"], "type": q["relation"],
         "level": "easy", "supporting_facts": [[q["title"], 0]]} for q in train])
    _write_jsonl(paths["eval"], [{"Question": q["question"], "Answer": q["answer"]}
                                 for q in evals])
    return {k: str(v) for k, v in paths.items()}

