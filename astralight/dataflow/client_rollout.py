"""The calls a RaaS makes through :class:`~astralight.dataflow.client.DataflowClient`: pool
membership (register, heartbeat, drain, deregister) and its tasks (lease, return, push,
push_many).

Every call that names an instance sends the secret its registration answered
(:data:`~astralight.dataflow.client_credentials.INSTANCE_SECRETS`, kept for the process).
:meth:`RolloutCalls.push_many` answers per item, exactly what :meth:`RolloutCalls.push` of that
item alone would answer, whatever the service refused as a whole.
"""

from __future__ import annotations

from typing import Any

from astralight.dataflow.client_credentials import INSTANCE_SECRETS
from astralight.dataflow.client_errors import DataflowError
from astralight.protocol import Sample, Task, expect


class RolloutCalls:
    """Mixed into :class:`~astralight.dataflow.client.DataflowClient`, whose ``_call`` carries
    every request (``instance_id``: the instance it acts as, whose secret goes with it)."""

    # ------------------------------------------------------------------ membership

    def register(self, model_ids: list[str], capacity: int, instance_id: str | None = None,
                 meta: dict | None = None, capacity_units: float = 1.0,
                 limits: dict | None = None) -> dict:
        """Join the pool (``capacity``: most tasks at once; ``capacity_units``: GPUs or CPU slots).
        Registering a known ``instance_id`` again makes it active, its counters kept (while it
        is live, only with its secret: this process sends the one it holds). The reply's
        ``instance_secret`` is kept and sent with every later call naming the instance.
        ``limits``: ``{model_id: {vocab_size, max_model_len}}`` of this instance's engines; the
        dataflow refuses pushed samples outside them."""
        body = {"model_ids": list(model_ids), "capacity": capacity, "instance_id": instance_id,
                "meta": meta or {}, "capacity_units": float(capacity_units)}
        if limits:
            body["limits"] = limits
        reply = self._call("POST", "/v1/register", body, instance_id=instance_id)
        if isinstance(reply, dict) and reply.get("instance_secret") and reply.get("instance_id"):
            INSTANCE_SECRETS.put(self.url, reply["instance_id"], str(reply["instance_secret"]))
        return reply

    def heartbeat(self, instance_id: str, in_flight: int | None = None,
                  stats: dict | None = None) -> dict:
        """Renew; the reply's ``drain`` says the dataflow wants this instance to drain.
        ``stats``: cumulative figures for the instance table (``weight_pause_s``, ...)."""
        body: dict = {"instance_id": instance_id}
        if in_flight is not None:
            body["in_flight"] = int(in_flight)
        if stats:
            body["stats"] = {k: float(v) for k, v in stats.items()}
        return self._call("POST", "/v1/heartbeat", body, instance_id=instance_id)

    def drain(self, instance_id: str) -> dict:
        """Ask an instance to drain: no new tasks, its heartbeat replies ``drain=True``.
        Returns ``{instance_id, state, in_flight}``."""
        return self._call("POST", f"/v1/instances/{instance_id}/drain", instance_id=instance_id)

    def deregister(self, instance_id: str) -> dict:
        """Leave the pool, returning every task still leased. Returns ``{"returned": n}``."""
        return self._call("POST", "/v1/deregister", {"instance_id": instance_id},
                          instance_id=instance_id)

    # ------------------------------------------------------------------ tasks

    def lease(self, instance_id: str, max_tasks: int, wait_s: float = 0.0) -> list[Task]:
        """Lease up to ``max_tasks``. ``wait_s`` > 0: if none can be granted now, the dataflow
        holds the request until some can (room opened) or ``wait_s`` passes (a long poll; the
        dataflow bounds it by its ``max_pull_timeout_s``), so a RaaS starts work as soon as
        the trainers make room instead of at its next poll."""
        body: dict = {"instance_id": instance_id, "max_tasks": max_tasks}
        if wait_s > 0:
            body["wait_s"] = float(wait_s)
        out = self._call("POST", "/v1/lease", body, instance_id=instance_id,
                         timeout=self.timeout + max(0.0, wait_s))
        return [expect(t, Task, "tasks[]") for t in out["tasks"]]

    def return_tasks(self, instance_id: str, task_ids: list[str], failed: bool = False) -> dict:
        """Hand back leased tasks not pushed (leasable again at once); ``failed``: they could
        not be run (counts against the instance's health). Returns ``{"returned": n}``."""
        return self._call("POST", "/v1/return", {"instance_id": instance_id,
                                                 "task_ids": list(task_ids), "failed": bool(failed)},
                          instance_id=instance_id)

    def push(self, instance_id: str, task_id: str, samples: list) -> dict:
        """Push one task's samples; returns ``{accepted, filtered, duplicate}`` once they are
        durable. Idempotent: a task already accepted answers ``duplicate=True``. Names
        :attr:`push_run_id` when set (a dataflow of another run refuses: 409 ``run_id``)."""
        return self._call("POST", "/v1/push", self._with_run({
            "instance_id": instance_id, "task_id": task_id, "samples": list(samples)}),
            instance_id=instance_id)

    def _with_run(self, body: dict) -> dict:
        """``body`` naming :attr:`push_run_id` (the run the samples were generated for), if set:
        a dataflow of another run refuses the push (409 ``run_id``)."""
        run_id = getattr(self, "push_run_id", None)
        return {**body, "run_id": run_id} if run_id else body

    def push_many(self, instance_id: str,
                  items: list[tuple[str, list[Sample]]]) -> list[dict | Exception]:
        """Push several tasks' samples in one request (``POST /v1/push_many``).

        Returns, per item and in order, what :meth:`push` of that item alone would return (its
        reply dict) or raise (the :class:`DataflowError`, with ``status`` and ``field`` as push
        would give them), so one bad item never fails the others; every reply comes once the
        accepted items are durable. A request the service refuses as a whole is handled so that
        this still holds: too big (413) is split in halves and sent again; a body that does not
        decode because of one item (the field names ``items[i]``) is sent again item by item
        (push); any other refusal (auth, a bad ``instance_id``) or an unreachable service is
        every item's exception. Bad arguments (not ``(task_id, samples)`` pairs) raise here.
        """
        items = [self._push_item(i, item) for i, item in enumerate(items)]
        if not items:
            return []
        try:
            out = self._call("POST", "/v1/push_many", self._with_run({
                "instance_id": instance_id, "items": [
                    {"task_id": task_id, "samples": samples} for task_id, samples in items]}),
                instance_id=instance_id)
            return [self._push_result(r) for r in out["results"]]
        except DataflowError as exc:
            return self._push_many_refused(instance_id, items, exc)

    @staticmethod
    def _push_item(i: int, item: Any) -> tuple[str, list]:
        """``(task_id, samples)`` from an argument item, or TypeError naming ``items[i]``."""
        try:
            task_id, samples = item
        except (TypeError, ValueError):
            raise TypeError(f"items[{i}]: expected a (task_id, samples) pair, got "
                            f"{type(item).__name__}") from None
        if not isinstance(task_id, str):
            raise TypeError(f"items[{i}]: task_id must be a str, got {type(task_id).__name__}")
        return task_id, list(samples)

    @staticmethod
    def _push_result(r: dict) -> dict | DataflowError:
        """One item's answer: the push reply, or the error push would have raised."""
        if r.get("status") == 200:
            return r["reply"]
        return DataflowError(r.get("status"), str(r.get("error")), r.get("field"))

    def _push_many_refused(self, instance_id: str, items: list[tuple[str, list]],
                           exc: DataflowError) -> list[dict | Exception]:
        """Per-item outcomes of a ``push_many`` request the service refused as a whole."""
        results = (exc.payload or {}).get("results")
        if isinstance(results, list) and len(results) == len(items):  # every item was refused
            return [self._push_result(r) for r in results]
        if exc.status == 413 and len(items) > 1:  # over max_body_bytes: halves, recursively
            half = len(items) // 2
            return (self.push_many(instance_id, items[:half])
                    + self.push_many(instance_id, items[half:]))
        names_an_item = (exc.field or "").startswith(("items[", "body.items["))
        if exc.status == 413 or (exc.status is not None and exc.status < 500 and names_an_item):
            return [self._push_alone(instance_id, task_id, samples) for task_id, samples in items]
        return [exc] * len(items)

    def _push_alone(self, instance_id: str, task_id: str, samples: list) -> dict | Exception:
        """:meth:`push` of one item, its exception returned rather than raised."""
        try:
            return self.push(instance_id, task_id, samples)
        except DataflowError as exc:
            return exc
