"""What the progress line says about trouble the numbers do not show: errors in the components'
logs, and a rollout stream that is mostly dropped as stale.

Why: a component can fail the same way every few seconds while the run looks alive (a RaaS that
cannot load a published version keeps generating with an old one, and every rollout is then
dropped as stale); the cause sat in ``logs/raas-0.log`` while the terminal showed a growing ETA.

- :class:`ErrorWatch` reads what each component appended to its log since the launch began and
  counts its error lines (``ERROR`` as a level, the first line of a Python traceback), keeping
  the last one: ``| errors raas-0 12 (last: policy: loading v4 into the engine failed ...)``.
- :class:`StaleWatch` measures the share of rollouts dropped as stale between two looks and
  says so when more than half were: ``| stale 62% of the last 640 rollouts``, and once a minute
  a warning line with the usual causes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

#: an error line: a log record at level ERROR (or CRITICAL), or the start of a traceback
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|^Traceback \(most recent call last\)")
#: bytes read from one log per look at most (a log flooding with output is skipped ahead)
MAX_READ = 1 << 20
#: the share of stale rollouts above which the progress line warns
STALE_WARN_SHARE = 0.5
#: rollouts between two looks below which the share says nothing
STALE_MIN_ROLLOUTS = 32


class ErrorWatch:
    """Error lines per component log, counted from the launch's start (``logs`` maps a
    component name to its log path; a log that does not exist yet is read once it does)."""

    def __init__(self, logs: dict[str, Path]):
        self.logs = dict(logs)
        self.offsets = {name: _size(path) for name, path in self.logs.items()}
        self.counts: dict[str, int] = {}
        self.last: dict[str, str] = {}

    def poll(self) -> None:
        """Read what each log gained since the last look."""
        for name, path in self.logs.items():
            size = _size(path)
            start = self.offsets.get(name, 0)
            if size < start:  # truncated or replaced: read it from the top
                start = 0
            if size == start:
                continue
            start = max(start, size - MAX_READ)
            with open(path, "rb") as f:
                f.seek(start)
                chunk = f.read(size - start)
            # an unfinished last line is read at the next look
            end = chunk.rfind(b"\n") + 1
            self.offsets[name] = start + end
            for line in _lines(chunk[:end]):
                if ERROR_LINE.search(line):
                    self.counts[name] = self.counts.get(name, 0) + 1
                    self.last[name] = line

    def text(self, width: int = 110) -> str:
        """``| errors raas-0 12 (last: ...)``, the component with the most first; empty when no
        log has an error line."""
        if not self.counts:
            return ""
        worst = max(self.counts, key=lambda n: (self.counts[n], n))
        others = "".join(f", {n} {c}" for n, c in sorted(self.counts.items()) if n != worst)
        last = _strip_prefix(self.last[worst])
        if len(last) > width:
            last = last[:width - 3] + "..."
        return f" | errors {worst} {self.counts[worst]}{others} (last: {last})"


class StaleWatch:
    """The share of rollouts dropped as stale between two looks (``rollouts_generated`` and
    ``stale_dropped`` of the policy's stats)."""

    def __init__(self, warn_every_s: float = 60.0):
        self.prev: tuple[int, int] | None = None
        self.share: float | None = None
        self.window = 0
        self.warn_every_s = warn_every_s
        self.warned_at: float | None = None

    def update(self, rollouts: int, stale: int) -> None:
        if self.prev is not None and rollouts - self.prev[0] >= STALE_MIN_ROLLOUTS:
            self.window = rollouts - self.prev[0]
            self.share = max(0.0, min(1.0, (stale - self.prev[1]) / self.window))
            self.prev = (rollouts, stale)
        elif self.prev is None or rollouts < self.prev[0]:
            self.prev = (rollouts, stale)

    @property
    def high(self) -> bool:
        return self.share is not None and self.share > STALE_WARN_SHARE

    def text(self) -> str:
        """``| stale 62% of the last 640 rollouts`` while more than half are dropped."""
        if not self.high:
            return ""
        return f" | stale {100 * self.share:.0f}% of the last {self.window} rollouts"

    def warning(self, now: float) -> str | None:
        """The warning line, at most once per ``warn_every_s`` while the share is high."""
        if not self.high or (self.warned_at is not None
                             and now - self.warned_at < self.warn_every_s):
            return None
        self.warned_at = now
        return (f"[launch] warning: {100 * self.share:.0f}% of the last {self.window} rollouts "
                "were dropped as stale (older than dataflow.max_staleness versions): the "
                "rollout services are behind the trainer. Look for errors in logs/raas-*.log (a "
                "weight version the engine cannot load leaves it on an old one), or raise "
                "dataflow.max_staleness, or give the RaaS more capacity")


def _size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def _lines(chunk: bytes) -> Iterable[str]:
    for raw in chunk.splitlines():
        yield raw.decode("utf-8", errors="replace").strip()


def _strip_prefix(line: str) -> str:
    """The message of a log record, without its time stamp and level (the common formats:
    ``2026-12-07 01:02:03,456 ERROR name: message`` and vLLM's ``(pid) ERROR 12-07 ... [f.py:1]
    message``), and a dotted logger name before the message."""
    m = re.search(r"\b(?:ERROR|CRITICAL)\b\s*(?:\d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?"
                  r"(?:\w+(?:\.\w+)+: )?(.*)", line)
    return (m.group(1) if m else line).strip()


__all__ = ["ErrorWatch", "StaleWatch", "ERROR_LINE", "STALE_WARN_SHARE"]
