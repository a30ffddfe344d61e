"""What the launcher reads from the dataflow while a run goes on: readiness, stats, evaluations,
per-version counters and balance reports, evaluation requests at a stop, and when a restarted
component has recovered.

Every read goes through :class:`astralight.dataflow.client.DataflowClient` with the admin token
(:func:`astralight.dataflow.auth.admin_token`: the progress view reads stats, an admin call when
tokens are scoped) and no retrying: the launcher polls again a second later, so an unanswered
read only counts as a missed poll.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from astralight.dataflow.client import DataflowClient

if TYPE_CHECKING:
    from astralight.launch.components import Component
    from astralight.launch.supervise import Supervisor


def dataflow_client(url: str, timeout: float = 5.0, retry_s: float = 0.0) -> DataflowClient:
    """A client of the dataflow at ``url`` holding the admin token (read when it is made)."""
    from astralight.dataflow.auth import admin_token

    return DataflowClient(url, token=admin_token(), timeout=timeout, retry_s=retry_s)


def read_stats(url: str) -> dict:
    """The dataflow's ``/v1/stats`` (raises when it does not answer)."""
    with dataflow_client(url) as client:
        return client.stats()


def _wait_ready(url: str, component: Component, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not component.alive():
            raise RuntimeError(f"{component.name} exited during start-up:\n{component.tail()}")
        try:
            with dataflow_client(url, timeout=2.0) as client:
                client.info()
            return
        except Exception:
            time.sleep(0.3)
    raise RuntimeError(f"{component.name} not ready after {timeout_s:.0f}s:\n{component.tail()}")


def _eval_table(url: str, model_id: str) -> dict[int, dict]:
    try:
        with dataflow_client(url) as client:
            return client.eval_results(model_id)
    except Exception:
        return {}


def _per_version_counters(url: str, model_id: str) -> dict | None:
    """The dataflow's counters per version of ``model_id`` (``{"<v>": {name: int}}``), or None.

    None when the route is missing or fails: the summary says "not known" rather than failing a
    run that has otherwise finished.
    """
    try:
        with dataflow_client(url) as client:  # the route's own answer, versions keyed as sent
            table: Any = client._send("GET", f"/v1/counters/{model_id}").json()
    except Exception as exc:
        print(f"[launch] per-version counters not available ({exc})", flush=True)
        return None
    versions = table.get("versions") if isinstance(table, dict) else None
    return versions if isinstance(versions, dict) else None


def _balance_report(url: str, model_id: str, window: int, last: int) -> dict | None:
    """The dataflow's balance report over the ``window`` versions up to ``last``
    (:class:`astralight.launch.balance.BalanceLog` writes it); None when the route is unavailable
    (the run goes on)."""
    try:
        with dataflow_client(url) as client:
            return client.balance(model_id, window=int(window), last=int(last))
    except Exception as exc:
        print(f"[launch] balance report not available ({exc})", flush=True)
        return None


def _eval_requester(url: str):
    """``request(model_id, version) -> bool``: ask the dataflow to evaluate that version now
    (``POST /v1/eval``, whatever ``eval.every`` says); True once accepted. A refusal is printed
    once per version (the stop sequence asks again at its next step)."""
    told: set[tuple[str, int]] = set()

    def request(model_id: str, version: int) -> bool:
        try:
            with dataflow_client(url, timeout=10.0, retry_s=2.0) as client:
                client.request_eval(model_id, version)
            return True
        except Exception as exc:
            if (model_id, version) not in told:
                told.add((model_id, version))
                print(f"[launch] evaluation of {model_id} v{version} not scheduled yet ({exc})",
                      flush=True)
            return False

    return request


def _mark_recoveries(sup: Supervisor, comps: list[Component], marks: dict,
                     progress: dict) -> None:
    """Stamp ``recovered_at`` on restarted components that made progress again, judged on a
    stats read (``progress``) taken after their restart: the dataflow answers; a trainer's policy
    has a newer version, a RaaS (or the autoscaler's pool) more rollouts than at the first stats
    read after the crash (``marks``, filled here)."""
    by_name = {c.name: c for c in comps}
    at = progress["at"]
    for event in sup.events:
        if event.recovered_at is not None:
            continue
        if id(event) not in marks and progress["stats_ok"]:
            marks[id(event)] = (progress["version"], progress["rollouts"])
        if event.restarted_at is None or at <= event.restarted_at or not progress["stats_ok"]:
            continue
        kind = by_name[event.component].kind
        version, rollouts = marks.get(id(event), (progress["version"], progress["rollouts"]))
        if (kind == "dataflow"
                or kind == "trainer" and progress["version"] > version
                or kind in ("raas", "autoscale") and progress["rollouts"] > rollouts):
            event.recovered_at = at
            print(f"[launch] {event.component} recovered {event.recovery_s:.1f}s after its exit",
                  flush=True)
