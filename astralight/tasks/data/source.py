"""Prompt sources over local dataset files: field mapping, templates, chat, length filtering.

:class:`FileSource` reads every row once at construction (see
:mod:`astralight.tasks.data.readers` for the formats), maps fields to a :class:`Prompt`, drops
what cannot be used -- duplicates, rows missing a field, rows a preset rejects, prompts longer
than ``max_prompt_tokens`` -- counting and logging each kind of drop (``source.stats``), and then
serves ``get(i)`` from memory, deterministically (optionally in one seeded shuffled order).
:class:`MultiBenchmarkSource` concatenates several sources into one eval set, each prompt tagged
with its benchmark's name, which the eval report groups by.

The prompt a task carries (``prompt_format``):

- ``text``: the rendered template; the workflow tokenizes it (plainly, or through its engine's
  chat template when the workflow is configured so);
- ``messages``: ``[{system}, {user: text}]``, which workflows put through the engine's chat
  template;
- ``tokens``: token ids made here by the tokenizer at ``tokenizer_path`` (its chat template when
  ``chat_template``), so the RaaS tokenizes nothing (tokens in, tokens out).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from astralight.tasks.base import Prompt, PromptSource, check_index
from astralight.tasks.data.fields import (FieldError, get_path, json_safe, pick,
                                          render_template, template_fields)
from astralight.tasks.data.readers import read_records

log = logging.getLogger(__name__)

__all__ = ["FileSource", "MultiBenchmarkSource", "SkipRow", "answer_text", "load_tokenizer"]

PROMPT_FORMATS = ("text", "messages", "tokens")


class SkipRow(Exception):
    """Raised by a preset's hook to drop one row; the message is the reason (counted)."""


def answer_text(value: Any) -> str:
    """Ground truth as text: an integral float (Parquet often stores 27.0) as ``27``; a
    solution with a ``\\boxed{}`` answer as that answer."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return answer_text(value[0])
    text = str(value).strip()
    if "\\boxed" in text or "\\fbox" in text:
        from astralight.rewards.math import last_boxed

        text = last_boxed(text) or text
    return text


def load_tokenizer(path: str):
    """The Hugging Face tokenizer saved at a local ``path`` (nothing is downloaded)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer_path: {path!r} does not exist (a local folder with "
                                "tokenizer files is needed; nothing is downloaded)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _first_columns(spec) -> set[str]:
    if spec is None:
        return set()
    paths = [spec] if isinstance(spec, str) else list(spec)
    return {p.split(".")[0] for p in paths}


class FileSource(PromptSource):
    """Prompts from a local JSONL / JSON / Parquet file, a ``save_to_disk`` folder or a glob.

    Args:
        path: the file, folder or glob (or a list of them, concatenated).
        split: the split of a ``DatasetDict`` folder / the shard-name prefix in a Parquet folder.
        prompt_field: dotted path(s) of the problem text (first present wins).
        answer_field: path(s) of the ground truth, stored as ``metadata["answer"]`` (text); None
            for data sets without one (code: the preset stores tests instead).
        id_field: path(s) of a stable id (``prompt_id``); default ``{benchmark or file}:{row}``.
        metadata_fields: ``{metadata key: path}`` copied into the task metadata when present.
        prompt_template: the prompt text, with ``{prompt}`` (the mapped problem) and any
            ``{column.path}``; LaTeX braces such as ``\\boxed{}`` are left as written.
        system_prompt: a system message (``messages`` / ``tokens`` formats).
        prompt_format: ``text``, ``messages`` or ``tokens`` (see the module docstring).
        chat_template: with ``tokens``: apply the tokenizer's chat template (else plain text
            tokens); with ``text``: count lengths as the chat template would make them.
        tokenizer_path: local tokenizer folder, for ``tokens`` and for length filtering.
        max_prompt_tokens: drop prompts longer than this many tokens (counted once, here).
        benchmark: name stored as ``metadata["benchmark"]`` (eval reports group by it).
        dedupe_field: drop rows whose value of this path repeats an earlier row's.
        shuffle_seed: serve the rows in one seeded random order instead of file order.
        limit: keep only the first ``limit`` prompts (after filtering and shuffling).
    """

    #: top-level columns a preset's hooks need besides the mapped fields
    extra_columns: tuple[str, ...] = ()

    def __init__(self, path: str | list[str], split: str | None = None,
                 prompt_field: str | list[str] = "prompt",
                 answer_field: str | list[str] | None = "answer",
                 id_field: str | list[str] | None = None,
                 metadata_fields: dict[str, str] | None = None,
                 prompt_template: str = "{prompt}", system_prompt: str | None = None,
                 prompt_format: str = "text", chat_template: bool = False,
                 tokenizer_path: str | None = None, max_prompt_tokens: int | None = None,
                 benchmark: str | None = None, dedupe_field: str | None = None,
                 shuffle_seed: int | None = None, limit: int | None = None):
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format: one of {PROMPT_FORMATS}, got {prompt_format!r}")
        if prompt_format == "tokens" and tokenizer_path is None:
            raise ValueError("tokenizer_path: required with prompt_format: tokens")
        if max_prompt_tokens is not None:
            if tokenizer_path is None:
                raise ValueError("tokenizer_path: required to filter by max_prompt_tokens "
                                 "(lengths are counted in that tokenizer's tokens)")
            if max_prompt_tokens < 1:
                raise ValueError(f"max_prompt_tokens: must be >= 1, got {max_prompt_tokens}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        self.path, self.split = path, split
        self.prompt_field, self.answer_field, self.id_field = prompt_field, answer_field, id_field
        self.metadata_fields = dict(metadata_fields or {})
        self.prompt_template, self.system_prompt = prompt_template, system_prompt
        self.prompt_format, self.chat_template = prompt_format, chat_template
        self.tokenizer_path, self.max_prompt_tokens = tokenizer_path, max_prompt_tokens
        self.benchmark = benchmark
        self.dedupe_field, self.shuffle_seed, self.limit = dedupe_field, shuffle_seed, limit
        #: what reading kept and dropped: rows, duplicates, invalid, skipped, too_long, kept
        self.stats: dict[str, int] = {}
        #: why rows were skipped or invalid: {reason: count}
        self.drop_reasons: Counter = Counter()
        self._items: list[tuple[str, Any, dict]] = []
        self._load()

    # ------------------------------------------------------------------ hooks for presets

    def clean_prompt(self, text: str) -> str:
        """The mapped problem text before templating (presets strip their own instructions)."""
        return text

    def row_metadata(self, record: dict) -> dict:
        """Extra task metadata of one row; raise :class:`SkipRow` to drop the row."""
        return {}

    # ------------------------------------------------------------------ PromptSource

    def __len__(self) -> int:
        return len(self._items)

    def get(self, index: int) -> Prompt:
        prompt_id, prompt, metadata = self._items[check_index(index, len(self._items),
                                                               where=self._tag())]
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        elif isinstance(prompt, list):
            prompt = [dict(m) for m in prompt]
        return Prompt(prompt_id=prompt_id, prompt=prompt, metadata=dict(metadata))

    # ------------------------------------------------------------------ construction

    def _tag(self) -> str:
        if self.benchmark:
            return self.benchmark
        first = self.path[0] if isinstance(self.path, (list, tuple)) else self.path
        return Path(str(first)).name.split(".")[0] or "data"

    def _columns(self) -> set[str]:
        cols = set(self.extra_columns)
        for spec in (self.prompt_field, self.answer_field, self.id_field, self.dedupe_field):
            cols |= _first_columns(spec)
        cols |= {p.split(".")[0] for p in self.metadata_fields.values()}
        cols |= {name.split(".")[0] for name in template_fields(self.prompt_template)}
        return cols

    def _load(self) -> None:
        records, duplicates = read_records(self.path, self.split, self._columns(),
                                           dedupe_key=self.dedupe_field)
        tag = self._tag()
        items, first_error = [], None
        invalid = skipped = 0
        self._unresolved: set[str] = set()
        for row, record in enumerate(records):
            try:
                items.append(self._build(record, row, tag))
            except SkipRow as exc:
                skipped += 1
                self.drop_reasons[str(exc)] += 1
            except KeyError as exc:
                invalid += 1
                message = exc.args[0] if exc.args else repr(exc)
                reason = exc.reason if isinstance(exc, FieldError) else str(message)[:200]
                self.drop_reasons[f"invalid: {reason}"] += 1
                first_error = first_error or f"row {row}: {message}"
        if self._unresolved:
            log.warning("%s: prompt_template placeholders %s match no field and were left as "
                        "written (fine for LaTeX; a typo otherwise)", tag,
                        ", ".join("{%s}" % n for n in sorted(self._unresolved)))
        if not items and records:
            raise ValueError(f"{tag}: no usable row in {self.path} "
                             f"({dict(self.drop_reasons)}); first problem: {first_error}")
        too_long = 0
        if self.tokenizer_path is not None:
            items, too_long = self._tokenize_and_filter(items)
        if self.shuffle_seed is not None:
            order = np.random.default_rng(self.shuffle_seed).permutation(len(items))
            items = [items[i] for i in order]
        if self.limit is not None:
            items = items[:self.limit]
        self._items = items
        self.stats = {"rows": len(records) + duplicates, "duplicates": duplicates,
                      "invalid": invalid, "skipped": skipped, "too_long": too_long,
                      "kept": len(items)}
        log.info("%s: %d prompts from %s (%s)", tag, len(items), self.path,
                 ", ".join(f"{k}={v}" for k, v in self.stats.items()))
        if invalid:
            log.warning("%s: %d rows lack a mapped field and were dropped; first: %s", tag,
                        invalid, first_error)
        if not items:
            raise ValueError(f"{tag}: no prompt left after filtering ({self.stats})")

    def _build(self, record: dict, row: int, tag: str) -> tuple[str, Any, dict]:
        raw = pick(record, self.prompt_field, "prompt_field")
        if not isinstance(raw, str):
            raise FieldError("prompt_field", f"holds a {type(raw).__name__}, expected text",
                             "point prompt_field at the text, e.g. prompt.0.content")
        text = render_template(self.prompt_template, {"prompt": self.clean_prompt(raw)}, record,
                               self._unresolved)
        metadata: dict[str, Any] = {}
        if self.answer_field is not None:
            metadata["answer"] = answer_text(pick(record, self.answer_field, "answer_field"))
        for key, path in self.metadata_fields.items():
            try:
                metadata[key] = json_safe(get_path(record, path))
            except KeyError:
                pass
        metadata.update(self.row_metadata(record))
        if self.benchmark:
            metadata["benchmark"] = self.benchmark
        if self.id_field is not None:
            prompt_id = str(pick(record, self.id_field, "id_field"))
        else:
            prompt_id = f"{tag}:{row}"
        if self.prompt_format == "text":
            prompt: Any = text
        else:
            prompt = ([{"role": "system", "content": self.system_prompt}]
                      if self.system_prompt else []) + [{"role": "user", "content": text}]
        return prompt_id, prompt, metadata

    def _tokenize_and_filter(self, items: list) -> tuple[list, int]:
        """Token ids (``tokens``) and lengths of every prompt, in batches; drop the long ones."""
        tok = load_tokenizer(self.tokenizer_path)
        chat = self.prompt_format == "messages" or self.chat_template
        if chat and not getattr(tok, "chat_template", None):
            raise ValueError(f"chat_template: the tokenizer at {self.tokenizer_path} has no chat "
                             "template; set chat_template: false or use another tokenizer")
        system = self.system_prompt if self.prompt_format != "text" else None
        kept, too_long, batch = [], 0, 512
        for start in range(0, len(items), batch):
            chunk = items[start:start + batch]
            if chat:
                texts = [tok.apply_chat_template(_messages(p, system), tokenize=False,
                                                 add_generation_prompt=True)
                         for _, p, _ in chunk]
            else:
                texts = [p if isinstance(p, str) else p[-1]["content"] for _, p, _ in chunk]
            ids = tok(texts, add_special_tokens=False)["input_ids"]
            for (pid, prompt, meta), tokens in zip(chunk, ids):
                if self.max_prompt_tokens is not None and len(tokens) > self.max_prompt_tokens:
                    too_long += 1
                    continue
                if self.prompt_format == "tokens":
                    prompt = np.asarray(tokens, dtype=np.int32)
                kept.append((pid, prompt, meta))
        if too_long:
            log.info("%s: %d prompts longer than %d tokens dropped", self._tag(), too_long,
                     self.max_prompt_tokens)
        return kept, too_long


def _messages(prompt: Any, system_prompt: str | None) -> list[dict]:
    if isinstance(prompt, list):
        return prompt
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}]


class MultiBenchmarkSource(PromptSource):
    """Several finite sources served as one eval set, each prompt tagged with its benchmark.

    Prompt ``i`` is prompt ``i - offset`` of the source it falls in; its id becomes
    ``"{benchmark}:{id}"`` (unless it already starts so) and ``metadata["benchmark"]`` its
    benchmark's name, which :func:`astralight.dataflow.evals.aggregate` groups results by (see
    :meth:`benchmark_names`).

    Args:
        sources: the sources (``{class_path, init_args}`` each in YAML).
        names: one benchmark name per source; default each source's ``benchmark`` attribute.
    """

    def __init__(self, sources: list[PromptSource], names: list[str] | None = None):
        if not sources:
            raise ValueError("sources: give at least one source")
        if names is not None and len(names) != len(sources):
            raise ValueError(f"names: {len(names)} names for {len(sources)} sources")
        self.sources = list(sources)
        self.names = []
        for i, src in enumerate(self.sources):
            name = names[i] if names is not None else getattr(src, "benchmark", None)
            if not name:
                raise ValueError(f"names: source {i} ({type(src).__name__}) has no benchmark "
                                 "name; set its benchmark or pass names")
            self.names.append(str(name))
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"names: benchmark names must be distinct, got {self.names}")
        self.offsets = [0]
        for name, src in zip(self.names, self.sources):
            n = len(src)
            if n >= 2**40:
                raise ValueError(f"sources: {name} is endless; an eval set must be finite")
            self.offsets.append(self.offsets[-1] + n)

    def __len__(self) -> int:
        return self.offsets[-1]

    def get(self, index: int) -> Prompt:
        check_index(index, len(self))
        k = bisect.bisect_right(self.offsets, index) - 1
        inner = self.sources[k].get(index - self.offsets[k])
        metadata = dict(inner.metadata)
        metadata["benchmark"] = self.names[k]
        prefix = f"{self.names[k]}:"
        prompt_id = inner.prompt_id if inner.prompt_id.startswith(prefix) else \
            prefix + inner.prompt_id
        return Prompt(prompt_id=prompt_id, prompt=inner.prompt, metadata=metadata)

    def benchmark_names(self) -> dict[int, str]:
        """``{prompt_index: benchmark}`` for every prompt (what the eval report groups by)."""
        out: dict[int, str] = {}
        for k, name in enumerate(self.names):
            out.update(dict.fromkeys(range(self.offsets[k], self.offsets[k + 1]), name))
        return out
