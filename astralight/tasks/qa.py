"""Question-answering prompts from local files: HotpotQA, Bamboogle and FlashRAG layouts.

The search agent's data (the AstraFlow paper's ASearcher analogue trains on multi-hop QA and
evaluates on HotpotQA, Bamboogle and the like). :class:`QASource` is a
:class:`~astralight.tasks.data.source.FileSource` (so JSONL / JSON / Parquet files, length
filtering, chat prompts, shuffling and limits all work as for the math sources) whose field
mapping is chosen by the file's layout, detected per file from its first row or set with
``format``:

=============  ===============================================  ============================
``format``     fields                                           gold answers
=============  ===============================================  ============================
``hotpotqa``   ``_id``, ``question``, ``answer``; optional      ``[answer]``
               ``type``, ``level`` (kept in the metadata),
               ``supporting_facts``, ``context``
``bamboogle``  ``Question``, ``Answer``                         ``[Answer]``
``flashrag``   ``id``, ``question``, ``golden_answers`` (the    ``golden_answers``
               FlashRAG / Search-R1 release of NQ, TriviaQA,
               HotpotQA, 2Wiki, MuSiQue, Bamboogle, ...)
=============  ===============================================  ============================

A prompt's metadata carries ``answers`` (every gold answer, what
:mod:`astralight.rewards.qa` scores against) and ``answer`` (the first, for tools that expect one).

Splits work as for the other file sources: a file is a split (the train file is the dataflow's
``source``, the dev / test file its ``eval.source``); ``split`` picks one split of a Hugging Face
``save_to_disk`` DatasetDict or of a folder of Parquet shards.

:func:`write_hotpotqa_corpus` turns HotpotQA's ``context`` paragraphs into a passage corpus for
:class:`~astralight.agents.search.BM25Search` (a small local stand-in for a Wikipedia index).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from astralight.tasks.data.fields import FieldError
from astralight.tasks.data.readers import read_records, resolve_paths
from astralight.tasks.data.source import FileSource

__all__ = ["QA_FORMATS", "QASource", "detect_format", "write_hotpotqa_corpus"]

#: format -> (id field or None, question field, answers field, metadata fields kept)
QA_FORMATS: dict[str, tuple[str | None, str, str, tuple[str, ...]]] = {
    "hotpotqa": ("_id", "question", "answer", ("type", "level")),
    "bamboogle": (None, "Question", "Answer", ()),
    "flashrag": ("id", "question", "golden_answers", ()),
}
_REQUIRED = {name: tuple(f for f in spec[:3] if f) for name, spec in QA_FORMATS.items()}


_HEAD_CHARS = 1 << 20


def _first_json_object(text: str) -> Any:
    """The first value of a JSON array (or of JSON lines) in ``text``; {} for an empty array,
    None when ``text`` does not hold a whole first value."""
    text = text.lstrip()
    body = text[1:].lstrip() if text.startswith("[") else text
    if not body or body.startswith("]"):
        return {}
    try:
        return json.JSONDecoder().raw_decode(body)[0]
    except json.JSONDecodeError:
        return None


def _first_row_columns(p: Path) -> set[str]:
    """The top-level fields of the first row of one file, read cheaply where the format
    allows (first line of JSONL, first object of a JSON array, a Parquet schema)."""
    name = p.name.lower()
    if p.is_file() and name.endswith(".jsonl"):
        with open(p, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"path: the first line of {p} is not JSON ({exc.msg})") \
                            from None
                    return set(row) if isinstance(row, dict) else set()
        return set()
    if p.is_file() and name.endswith(".json"):
        with open(p, encoding="utf-8") as fh:
            head = fh.read(_HEAD_CHARS)  # HotpotQA's train file is 0.5 GB; its first row is small
        row = _first_json_object(head)
        if row is None and len(head) == _HEAD_CHARS:  # a first row longer than the head
            row = _first_json_object(p.read_text(encoding="utf-8"))
        if row is None:
            raise ValueError(f"path: {p} does not start with a JSON object or array of objects")
        return set(row) if isinstance(row, dict) else set()
    if p.is_file() and name.endswith(".parquet"):
        from astralight.tasks.data.readers import require_pyarrow

        require_pyarrow()
        import pyarrow.parquet as pq

        return set(pq.read_schema(p).names)
    records, _ = read_records(str(p))
    return set(records[0]) if records else set()


def detect_format(columns: set[str], where: str = "the file") -> str:
    """The QA format whose required fields ``columns`` holds (HotpotQA, then FlashRAG, then
    Bamboogle); a ValueError listing the columns and the formats otherwise."""
    for name in ("hotpotqa", "flashrag", "bamboogle"):
        if set(_REQUIRED[name]) <= columns:
            return name
    expected = "; ".join(f"{n}: {', '.join(r)}" for n, r in _REQUIRED.items())
    raise ValueError(f"format: cannot tell the QA format of {where}: its first row has fields "
                     f"{sorted(columns)}; expected {expected}. Rename the fields or use "
                     "astralight.tasks.data.FileSource with your own field mapping")


def _answers(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        golds = [value]
    elif isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
        golds = [str(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        golds = [str(int(value)) if float(value).is_integer() else str(value)]
    else:
        raise FieldError(field, f"holds a {type(value).__name__}, expected text or a list of text")
    golds = [g.strip() for g in golds if g.strip()]
    if not golds:
        raise FieldError(field, "is empty", "every question needs a gold answer")
    return golds


class QASource(FileSource):
    """Questions and gold answers from local QA files (see the module docstring).

    Args:
        path: a file, folder or glob, or a list of them (each file's format detected on its own).
        format: ``auto`` (detect per file), ``hotpotqa``, ``bamboogle`` or ``flashrag``.
        prompt_template: the prompt text, ``{prompt}`` being the question.
        keep_supporting_facts: also carry HotpotQA's ``supporting_facts`` (``[[title,
            sentence], ...]``) in the metadata (off by default: every task carries its metadata).
        benchmark: the eval name in reports (default: the file name).
        **kwargs: every other :class:`FileSource` argument (``split``, ``system_prompt``,
            ``prompt_format``, ``tokenizer_path``, ``max_prompt_tokens``, ``shuffle_seed``,
            ``limit``, ``dedupe_field``, ...).
    """

    def __init__(self, path: str | list[str], format: str = "auto",
                 prompt_template: str = "{prompt}", keep_supporting_facts: bool = False,
                 benchmark: str | None = None, **kwargs):
        if format != "auto" and format not in QA_FORMATS:
            raise ValueError(f"format: one of auto, {', '.join(QA_FORMATS)}; got {format!r}")
        for key in ("prompt_field", "answer_field", "id_field", "metadata_fields"):
            if key in kwargs:
                raise ValueError(f"{key}: set by the QA format; choose format instead (or use "
                                 "astralight.tasks.data.FileSource for your own mapping)")
        self.format, self.keep_supporting_facts = format, keep_supporting_facts
        #: the format of every file read, by path
        self.formats: dict[str, str] = {}
        for p in resolve_paths(path):
            columns = _first_row_columns(p)
            if not columns:
                raise ValueError(f"path: {p} holds no question (its first row is empty or "
                                 "missing)")
            if format == "auto":
                self.formats[str(p)] = detect_format(columns, str(p))
            else:
                missing = [f for f in _REQUIRED[format] if f not in columns]
                if missing:
                    raise ValueError(f"format: {format} rows need the fields "
                                     f"{list(_REQUIRED[format])}; the first row of {p} lacks "
                                     f"{missing} (its fields: {sorted(columns)})")
                self.formats[str(p)] = format
        used = [QA_FORMATS[f] for f in dict.fromkeys(self.formats.values())]
        self._id_fields = [s[0] for s in used if s[0]]
        self._answer_fields = list(dict.fromkeys(s[2] for s in used))
        self._meta_fields = list(dict.fromkeys(m for s in used for m in s[3]))
        self.extra_columns = tuple(dict.fromkeys(
            self._id_fields + self._answer_fields + self._meta_fields
            + (["supporting_facts"] if keep_supporting_facts else [])))
        super().__init__(path, prompt_field=list(dict.fromkeys(s[1] for s in used)),
                         answer_field=None, id_field=None,
                         metadata_fields={m: m for m in self._meta_fields},
                         prompt_template=prompt_template, benchmark=benchmark, **kwargs)

    def row_metadata(self, record: dict) -> dict:
        for field in self._answer_fields:
            if record.get(field) is not None:
                golds = _answers(record[field], "answer_field")
                break
        else:
            raise FieldError("answer_field", f"none of {self._answer_fields} found",
                             f"the row has fields {sorted(record)}; a QA row needs its gold "
                             "answer")
        out: dict[str, Any] = {"answer": golds[0], "answers": golds}
        if self.keep_supporting_facts and record.get("supporting_facts") is not None:
            from astralight.tasks.data.fields import json_safe

            out["supporting_facts"] = json_safe(record["supporting_facts"])
        return out

    def _build(self, record: dict, row: int, tag: str):
        prompt_id, prompt, metadata = super()._build(record, row, tag)
        for field in self._id_fields:
            if record.get(field) is not None:
                prompt_id = str(record[field])
                break
        return prompt_id, prompt, metadata


def write_hotpotqa_corpus(path: str | list[str], out_path: str | os.PathLike) -> int:
    """Write the distinct ``context`` paragraphs of HotpotQA files as a passage corpus
    (``{"id", "title", "text"}`` JSONL, one paragraph per title); returns the passage count."""
    records, _ = read_records(path, columns={"context"})
    seen: dict[str, str] = {}
    for row, rec in enumerate(records):
        context = rec.get("context")
        if context is None:
            raise ValueError(f"path: row {row} has no 'context' (HotpotQA's [[title, "
                             "[sentences]], ...]); a corpus needs the distractor/fullwiki files")
        for item in context:
            title, sentences = item[0], item[1]
            text = "".join(str(s) for s in sentences).strip()
            if text and title not in seen:
                seen[str(title)] = text
    if not seen:
        raise ValueError(f"path: no context paragraph in {path}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        for i, (title, text) in enumerate(seen.items()):
            fh.write(json.dumps({"id": str(i), "title": title, "text": text},
                                ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return len(seen)
