"""Field mapping: pick values out of a dataset row by dotted paths, and render prompt templates.

A *field spec* is a dotted path into a row (``problem``, ``reward_model.ground_truth``,
``prompt.0.content`` -- list items by index), or a list of such paths tried in order (the first
one present and not null wins), so one preset reads every public variant of a data set
(``problem`` in one copy of AIME, ``Problem`` or ``question`` in another).

Templates use ``{name}`` placeholders, where ``name`` is a mapped field (``prompt``) or a dotted
path into the row; any other brace is left alone, so LaTeX such as ``\\boxed{}`` or ``\\frac{a}{b}``
can appear in a template as written (``{a}`` is kept as written when the row has no ``a``; the
source logs such names once, in case one is a typo; ``{{name}}`` always gives ``{name}``).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["get_path", "pick", "has_any", "render_template", "template_fields", "json_safe",
           "FieldError"]

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)\}")


def get_path(record: Any, path: str) -> Any:
    """``record`` navigated by a dotted path (``prompt.0.content``); KeyError when absent."""
    value = record
    for part in path.split("."):
        if isinstance(value, dict):
            if part not in value:
                raise KeyError(part)
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit():
            try:
                value = value[int(part)]
            except IndexError:
                raise KeyError(part) from None
        else:
            raise KeyError(part)
    return value


def _paths(spec: str | list[str]) -> list[str]:
    return [spec] if isinstance(spec, str) else list(spec)


class FieldError(KeyError):
    """A row lacks (or holds an unusable value for) the config field ``field``; ``reason`` is
    short and the same for every such row (it is what drop counts are keyed by)."""

    def __init__(self, field: str, reason: str, detail: str = ""):
        self.field, self.reason = field, f"{field}: {reason}"
        super().__init__(f"{self.reason}{'; ' + detail if detail else ''}")

    def __str__(self) -> str:
        return self.args[0]


def pick(record: dict, spec: str | list[str], field: str) -> Any:
    """The value of the first path of ``spec`` present (and not null) in ``record``.

    :class:`FieldError` (a KeyError) naming the config ``field``, the paths tried and the row's
    columns otherwise.
    """
    for path in _paths(spec):
        try:
            value = get_path(record, path)
        except KeyError:
            continue
        if value is not None:
            return value
    raise FieldError(field, f"none of {_paths(spec)} found",
                     f"the row has columns {sorted(record)}; set {field} to the right column")


def has_any(record: dict, spec: str | list[str]) -> bool:
    for path in _paths(spec):
        try:
            if get_path(record, path) is not None:
                return True
        except KeyError:
            pass
    return False


def template_fields(template: str) -> list[str]:
    """Placeholder names of ``template`` in order (escapes ``{{``/``}}`` excluded)."""
    return [m.group(1) for m in _PLACEHOLDER.finditer(template) if m.group(1)]


def render_template(template: str, values: dict, record: dict | None = None,
                    unresolved: set | None = None) -> str:
    """``template`` with ``{name}`` replaced from ``values`` first, then from ``record`` paths.

    A placeholder that is neither stays as written (LaTeX like ``\\frac{a}{b}`` needs no
    escaping); its name is added to ``unresolved`` so the caller can warn about typos.
    """
    def sub(m: re.Match) -> str:
        token = m.group(0)
        if token == "{{":
            return "{"
        if token == "}}":
            return "}"
        name = m.group(1)
        if name in values:
            return _text(values[name])
        if record is not None:
            try:
                return _text(get_path(record, name))
            except KeyError:
                pass
        if unresolved is not None:
            unresolved.add(name)
        return token

    return _PLACEHOLDER.sub(sub, template)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def json_safe(value: Any) -> Any:
    """``value`` made of JSON/msgpack types (task metadata crosses the wire as msgpack):
    dates, decimals, bytes and other objects become strings."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars / arrays
        return json_safe(value.tolist())
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
