"""The run folder's balance files: ``balance.txt`` (one readable line per window) and
``balance.jsonl`` (the same windows as data, one JSON report per line).

Windows are ``balance.every`` versions each and contiguous: ``[0, every-1]``, ``[every,
2*every-1]``, ... each asked for by its last version
(``GET /v1/balance/{model_id}?window=K&last=L``) once that version is complete, so a launcher that looks late (the version jumped from 79 to 81
between two looks) still writes ``71..80`` then ``81..90``, never skipping 81. At the end of the
run :meth:`BalanceLog.finish` writes the last window -- every version not reported yet, up to the
final one (still open: until now) -- marked ``"final": true``.

The decision line says who acts on it: with a fixed pool (no ``recipe.autoscale``) nothing does,
so it reads "advice only: fixed pool"; with ``recipe.autoscale`` the autoscaler acts on its own
reading of the same report every ``autoscale.every`` versions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

#: pool modes: nothing resizes a fixed pool; the autoscaler resizes an elastic one
FIXED, AUTOSCALE = "fixed", "autoscale"


def advice_text(pool_mode: str) -> str:
    """What the decision of a window is for, in the readable line."""
    if pool_mode == FIXED:
        return "advice only: fixed pool (no recipe.autoscale), nothing acts on it"
    return "the autoscaler acts on its own reading of this report (recipe.autoscale)"


def window_line(report: dict, pool_mode: str, final: bool = False) -> str:
    """One window of the balance report as a readable line."""
    d = report.get("decision") or {}
    first, last = report["versions"]
    return (f"versions {first}..{last}{' (final window, open until the end)' if final else ''}: "
            f"wait fraction {report['wait_fraction']:.1%}, produced {report['produced']}, "
            f"accepted {report['accepted']}, consumed {report['consumed']}, stale "
            f"{report['stale']}, weight pause {report.get('weight_pause_s', 0):.2f}s (RaaS "
            f"total), pool {d.get('pool')} -> {d.get('action')} {d.get('target')} "
            f"({d.get('reason')}); {advice_text(pool_mode)}")


def _json_value(line: str) -> Any:
    """The JSON value of one line; None when it does not parse (a line cut short by a crash)."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file (``balance.jsonl``, ``autoscale.jsonl``), in order;
    lines that do not parse or hold no object are skipped, and a missing file holds none."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    return [entry for entry in map(_json_value, lines) if isinstance(entry, dict)]


class BalanceLog:
    """Writes the balance windows of one policy into ``run_dir`` (see the module docstring).

    ``fetch(window, last)`` returns the dataflow's report of the ``window`` versions up to
    ``last``, or None when it cannot (the run goes on; that window is asked for again at the next
    :meth:`poll`). A resumed run continues after the last window its ``balance.jsonl`` holds.
    """

    def __init__(self, run_dir: Path, fetch: Callable[[int, int], dict | None], every: int,
                 pool_mode: str = FIXED):
        self.txt = Path(run_dir) / "balance.txt"
        self.jsonl = Path(run_dir) / "balance.jsonl"
        self.fetch = fetch
        self.every = int(every)
        self.pool_mode = pool_mode
        done = read_jsonl(self.jsonl)
        self.next_first = int(done[-1]["versions"][1]) + 1 if done else 0
        self.last: dict | None = done[-1] if done else None

    def poll(self, current: int) -> None:
        """Write every whole window whose versions are all complete (before ``current``)."""
        while self.every > 0 and self.next_first + self.every - 1 < current:
            if not self._write(self.next_first, self.next_first + self.every - 1, final=False):
                return

    def finish(self, current: int) -> None:
        """At the end of the run: the whole windows left, then the last (partial) window up to
        and including the final version ``current``."""
        if self.every <= 0:
            return
        self.poll(current)
        if self.next_first <= current:
            self._write(self.next_first, current, final=True)

    def _write(self, first: int, last: int, final: bool) -> bool:
        report = self.fetch(last - first + 1, last)
        if not report:
            return False
        record = {**report, "pool_mode": self.pool_mode, "advice_only": self.pool_mode == FIXED,
                  "final": final}
        self.txt.parent.mkdir(parents=True, exist_ok=True)
        with open(self.txt, "a") as f:
            f.write(window_line(report, self.pool_mode, final) + "\n")
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.next_first = int(report["versions"][1]) + 1
        self.last = record
        return True


__all__ = ["FIXED", "AUTOSCALE", "advice_text", "window_line", "read_jsonl", "BalanceLog"]
