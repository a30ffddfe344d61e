"""The table of sample completions per evaluated version, for TensorBoard and W&B.

Scalars say how often the policy is right; a few completions say how it is right or wrong (a
format it drifted into, an answer cut off by ``max_tokens``). :class:`DataflowMonitor` fetches
the rows from the dataflow (``GET /v1/eval/{model_id}/{version}/completions``) and logs them with
:func:`log_table` to every logger that can show a table:

* a logger with ``log_table(key, columns, data, step)`` -- Lightning's ``WandbLogger`` -- gets
  a table (W&B builds a ``wandb.Table``; nothing here imports wandb);
* a logger whose ``experiment`` has ``add_text`` -- TensorBoard -- gets a markdown table on the
  TEXT tab;
* any other logger (CSV, ...) gets nothing.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

COLUMNS = ("prompt", "completion", "reward", "finish_reason")
#: characters of a prompt / completion shown in a cell (the dataflow keeps up to 2000)
CELL_CHARS = 600


def table_rows(rows: Iterable[dict], decode: Callable[[list[int]], str] | None = None
               ) -> list[list[Any]]:
    """The dataflow's completion rows as table rows (:data:`COLUMNS`); a completion the
    workflow sent as token ids only is decoded with ``decode`` (else shown as the ids)."""
    out = []
    for row in rows:
        text = row.get("completion")
        if text is None and row.get("completion_ids") is not None:
            ids = list(row["completion_ids"])
            if decode is not None:
                try:
                    text = decode(ids)
                except Exception as exc:  # a table is never worth a failed step
                    log.debug("could not decode a completion: %s", exc)
            if text is None:
                text = f"token ids {ids}"
        reward = row.get("reward")
        out.append([_cell(row.get("prompt") or ""), _cell(text or ""),
                    float(reward) if isinstance(reward, (int, float)) else None,
                    row.get("finish_reason") or ""])
    return out


def _cell(text: str) -> str:
    text = str(text)
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS] + "…"


def markdown_table(columns: Iterable[str], data: list[list[Any]]) -> str:
    """A markdown table (what TensorBoard's text plugin renders); ``|`` and line breaks inside
    a cell are escaped so that every row stays one table row."""
    columns = list(columns)

    def cell(value: Any) -> str:
        text = f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", " ⏎ ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


def log_table(loggers: Iterable[Any], key: str, columns: Iterable[str], data: list[list[Any]],
              step: int) -> list[str]:
    """Log ``data`` under ``key`` at ``step`` to every logger that shows tables (see the module
    docstring); returns the class names of the loggers that got it."""
    columns = list(columns)
    reached = []
    for logger in loggers:
        try:
            if callable(getattr(logger, "log_table", None)):
                logger.log_table(key=key, columns=columns, data=data, step=step)
            else:
                add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
                if not callable(add_text):
                    continue
                add_text(key, markdown_table(columns, data), global_step=step)
            reached.append(type(logger).__name__)
        except Exception as exc:  # monitoring must never stop training
            log.warning("%s: could not log the %s table (%s)", type(logger).__name__, key, exc)
    return reached
