"""The access checks of the dataflow's HTTP face that need a request's body.

:class:`~astralight.dataflow.auth.AccessGuard` has already checked the token and that its scope
may call the route; what the body names is checked here, before anything reaches the core: a
trainer token bound to a model_id acts on that model_id only (and on its batches), and a rollout
caller acts only as an instance whose ``instance_secret`` (answered by register) it sends,
pushing only tasks leased to it. The admin scope passes every check.
"""

from __future__ import annotations

import time

from astralight.dataflow import auth, membership
from astralight.dataflow.auth import InstanceSecrets
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError


class BodyAccess:
    """The checks of the current caller (:func:`astralight.dataflow.auth.current`) against the
    model_id, batch, instance or tasks a request names; each raises a
    :class:`~astralight.dataflow.errors.ServiceError` naming the field."""

    def __init__(self, core: Dataflow, config: DataflowConfig, secrets: InstanceSecrets):
        self.core = core
        self.config = config
        #: the instance secrets registrations issue (kept in the core's store)
        self.secrets = secrets

    def own_model(self, model_id: str, name: str = "model_id") -> None:
        """A trainer token bound to a model_id acts on that model_id only."""
        p = auth.current().principal
        if p.scope == auth.TRAINER and p.model_id is not None and model_id != p.model_id:
            raise ServiceError(403, name, (
                f"this trainer token is bound to model_id {p.model_id!r} and cannot act on "
                f"{model_id!r}; the trainer of {model_id!r} needs its own token (astralight run "
                f"hands each trainer its own; or: python -m astralight.dataflow.auth "
                f"trainer-token {model_id})"))

    def own_batch(self, batch_id: str) -> None:
        """A bound trainer acks and extends only batches of its model_id (unknown ones: the
        core answers 404)."""
        p = auth.current().principal
        if p.scope == auth.TRAINER and p.model_id is not None:
            with self.core.lock:
                row = self.core.store.batch(batch_id)
            if row is not None:
                self.own_model(row["model_id"], "batch_id")

    def own_instance(self, instance_id: str) -> None:
        """A rollout caller acts as an instance only with its instance secret (admin: any)."""
        a = auth.current()
        if a.principal.admin:
            return
        ok = self.secrets.matches(instance_id, a.instance_secret)
        if ok is None:
            raise ServiceError(404, "instance_id", (
                f"unknown instance {instance_id!r} (or one registered before instances were "
                f"bound to a secret); register it (POST /v1/register) first"))
        if not ok:
            raise ServiceError(403, "instance_secret", (
                f"the {auth.INSTANCE_SECRET_HEADER} header is missing or is not the secret "
                f"instance {instance_id!r} got at registration; only that instance may act as it "
                f"(astralight.dataflow.client sends it by itself)"))

    def foreign_tasks(self, instance_id: str, task_ids: list[str]) -> set[str]:
        """For a rollout caller: the ``task_ids`` currently leased (or returned) by another
        instance, which it may not push (done tasks answer ``duplicate``, unknown ones 404)."""
        if auth.current().principal.admin or not task_ids:
            return set()
        with self.core.lock:
            rows = {t: self.core.store.task(t) for t in task_ids}
        return {t for t, row in rows.items() if row is not None and row["state"] != "done"
                and row["instance_id"] is not None and row["instance_id"] != instance_id}

    def instance_is_live(self, instance_id: str) -> bool:
        """Whether ``instance_id`` is registered and heard from within ``lease_seconds`` (call
        under the core's lock)."""
        row = self.core.store.instance(instance_id)
        return row is not None and membership.is_live(
            row["state"], time.time() - float(row["last_seen"]), self.config.lease_seconds)


def foreign_task_error(task_id: str) -> ServiceError:
    """The refusal of a push of a task another instance holds."""
    # 409, as for a task never leased: also what a late push gets once the expired lease
    # went to another instance, and the RaaS drops such a push without counting a failure
    return ServiceError(409, "task_id", (
        f"task {task_id!r} is leased to another instance; an instance pushes only the tasks "
        f"it leased (POST /v1/lease) and still holds"))
