"""Shared fakes of the dataflow for RaaS unit and integration tests (import from here, never
from another test module).

:class:`FakeStore` is the weight half of ``DataflowClient`` in memory; :class:`FakeDataflow`
adds register / heartbeat / lease / push / return / deregister (the membership half);
:class:`BatchingDataflow` adds ``push_many`` and a lock, for services pushing from several
threads. :func:`states` makes successive small weight states (like RL steps).
"""

from __future__ import annotations

import threading

import torch


class FakeStore:
    """The weight half of DataflowClient, in memory. ``corrupt`` names files served damaged."""

    def __init__(self):
        self.manifests, self.files, self.corrupt, self.corrupt_once = {}, {}, set(), set()
        self.downloads = []
        self.streamed = []

    def add(self, artifact):
        m = artifact.manifest
        self.manifests[m.version] = m
        for name, data in artifact.files.items():
            self.files[(m.version, name)] = data

    def latest_manifest(self, model_id):
        return self.manifests[max(self.manifests)] if self.manifests else None

    def manifest(self, model_id, version):
        return self.manifests[version]

    def download_weight_file(self, model_id, version, name):
        self.downloads.append((version, name))
        data = self.files[(version, name)]
        if (version, name) in self.corrupt_once:
            self.corrupt_once.discard((version, name))
            return data[:-1] + bytes([data[-1] ^ 1])
        return data[:-1] + bytes([data[-1] ^ 1]) if (version, name) in self.corrupt else data

    def download_weight_file_to(self, model_id, version, name, path):
        """Like DataflowClient's: writes the file and returns its path."""
        path.write_bytes(self.download_weight_file(model_id, version, name))
        self.streamed.append(path)
        return path

    def close(self):
        pass


def states(n, seed=0):
    """n successive small states, each changing a few elements (like RL steps)."""
    g = torch.Generator().manual_seed(seed)
    state = {"a.weight": torch.randn(8, 16, generator=g), "b.bias": torch.randn(16, generator=g)}
    out = []
    for _ in range(n):
        state = {k: v.clone() for k, v in state.items()}
        state["a.weight"][0, :3] += 0.5
        out.append(state)
    return out


class NotFound(Exception):
    status = 404

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


class FakeDataflow(FakeStore):
    """Register / heartbeat / lease / push / return / deregister in memory (the membership
    half of DataflowClient's contract), plus FakeStore's weight routes."""

    def __init__(self, tasks=()):
        super().__init__()
        self.tasks = list(tasks)
        self.pushed = {}
        self.registrations = 0
        self.register_calls = []  # (instance_id, capacity_units)
        self.registered_limits = None
        self.forget_instance = False
        self.leased = []  # every task id ever leased, in order
        self.returned = []  # (task_id, failed)
        self.deregistered = []
        self.heartbeats = []  # in_flight of each heartbeat
        self.heartbeat_stats = []  # stats of each heartbeat (None: none sent)
        self.drain_requested = False
        self.unknown_tasks = set()  # pushes of these answer 404 task_id (a fresh state)
        self.push_log = []  # every task id pushed, in order
        self.on_push = None  # called after every push, accepted or not (tests hook stops here)
        self.register_metas = []  # the meta of every registration
        #: the dataflow's ``workflow:`` setting; when set, a registration naming another workflow
        #: is refused as the real service refuses it (409 ``workflow``)
        self.workflow = None

    def register(self, model_ids, capacity, instance_id=None, meta=None, capacity_units=1.0,
                 limits=None):
        self.register_metas.append(dict(meta or {}))
        if self.workflow is not None:
            from astralight.dataflow.client import DataflowError
            from astralight.dataflow.errors import ServiceError
            from astralight.dataflow.membership import check_workflow

            try:
                check_workflow(meta or {}, self.workflow)
            except ServiceError as exc:
                raise DataflowError(exc.status, str(exc), exc.field) from None  # as on the wire
        self.registrations += 1
        self.register_calls.append((instance_id, capacity_units))
        self.registered_limits = limits  # the engines' limits of the last registration
        return {"instance_id": instance_id or "i0", "lease_seconds": 30.0}

    def heartbeat(self, instance_id, in_flight=None, stats=None):
        self.heartbeats.append(in_flight)
        self.heartbeat_stats.append(stats)
        return {"instance_id": instance_id, "lease_seconds": 30.0,
                "drain": self.drain_requested}

    def lease(self, instance_id, max_tasks):
        if self.forget_instance:
            self.forget_instance = False
            raise NotFound("unknown instance", "instance_id")
        out, self.tasks = self.tasks[:max_tasks], self.tasks[max_tasks:]
        self.leased += [t.task_id for t in out]
        return out

    def push(self, instance_id, task_id, samples):
        self.push_log.append(task_id)
        try:
            if task_id in self.unknown_tasks:
                raise NotFound(f"unknown task {task_id!r}", "task_id")
            dup = task_id in self.pushed
            self.pushed.setdefault(task_id, samples)
            return {"accepted": 0 if dup else len(samples), "duplicate": dup}
        finally:
            if self.on_push is not None:
                self.on_push(task_id)

    def return_tasks(self, instance_id, task_ids, failed=False):
        self.returned += [(t, failed) for t in task_ids]
        return {"returned": len(task_ids)}

    def deregister(self, instance_id):
        self.deregistered.append(instance_id)
        return {"returned": 0}


class BatchingDataflow(FakeDataflow):
    """A dataflow with ``push_many``: records how many tasks each push request carried."""

    def __init__(self, tasks=()):
        super().__init__(tasks)
        self.lock = threading.Lock()
        self.batches = []

    def lease(self, instance_id, max_tasks):
        with self.lock:
            return super().lease(instance_id, max_tasks)

    def push_many(self, instance_id, items):
        with self.lock:
            self.batches.append(len(items))
            out = []
            for task_id, samples in items:
                try:
                    out.append(FakeDataflow.push(self, instance_id, task_id, samples))
                except Exception as exc:  # noqa: BLE001 - per-item outcome
                    out.append(exc)
            return out

    def return_tasks(self, instance_id, task_ids, failed=False):
        with self.lock:
            return super().return_tasks(instance_id, task_ids, failed)
