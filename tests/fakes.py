"""What the components ask of the dataflow, and the stand-ins for it that tests share.

:class:`DataflowAPI` is the contract of :class:`astralight.dataflow.client.DataflowClient` as its
callers meet it, one :class:`typing.Protocol` per caller: the RaaS (:class:`MembershipAPI`,
:class:`WeightSourceAPI`), trainers (:class:`TrainerAPI`, :class:`PublisherAPI`), the monitors
and the autoscaler (:class:`ObserverAPI`, :class:`EvalAPI`). Two kinds of things implement it:

* :class:`InProcessDataflow`, the real behaviour: a real core
  :class:`~astralight.dataflow.core.Dataflow` (SQLite in a temporary folder) answered the way the
  client answers, with the wire's types (what msgpack / JSON return, refusals as
  :class:`~astralight.dataflow.client.DataflowError`) and no HTTP;
* scripted fakes, for a test that sets the answers or the failures itself and reads what was
  asked: each is registered with :func:`dataflow_fake`, naming the parts of the contract it
  implements whole.

:func:`app_client` is the real client itself, talking to the real app in process (a
``TestClient``, :class:`AppTransport`): for the routes' own behaviour without a socket.

``tests/unit/test_dataflow_api.py`` fails when the client, the adapter or a fake drifts from the
protocol (method names and parameters). A test that needs one odd answer subclasses a fake in
its own module; fakes of other things (engines, loggers, backends) are in ``tests/unit/*_fakes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch

from astralight.dataflow.client import DataflowClient, DataflowError
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.protocol import (Batch, ProtocolError, Sample, Task, WeightManifest, decode,
                                 encode)

# ----------------------------------------------------------------------------- the contract


class ObserverAPI(Protocol):
    """What the monitors, the launcher and the autoscaler read about the run."""

    def info(self) -> dict: ...

    def stats(self) -> dict: ...

    def balance(self, model_id: str, window: int = 10, pool: int | None = None,
                last: int | None = None) -> dict: ...

    def counters(self, model_id: str, since: int = 0) -> dict[int, dict[str, int]]: ...


class EvalAPI(Protocol):
    """The evaluations the trainer's monitor logs and the launcher's stop sequence asks for."""

    def eval_results(self, model_id: str) -> dict[int, dict]: ...

    def eval_completions(self, model_id: str, version: int,
                         limit: int | None = None) -> list[dict]: ...

    def request_eval(self, model_id: str, version: int) -> dict: ...


class MembershipAPI(Protocol):
    """A RaaS instance in the pool (and ``drain``, the autoscaler's and an operator's ask)."""

    def register(self, model_ids: list[str], capacity: int, instance_id: str | None = None,
                 meta: dict | None = None, capacity_units: float = 1.0,
                 limits: dict | None = None) -> dict: ...

    def heartbeat(self, instance_id: str, in_flight: int | None = None,
                  stats: dict | None = None) -> dict: ...

    def drain(self, instance_id: str) -> dict: ...

    def return_tasks(self, instance_id: str, task_ids: list[str],
                     failed: bool = False) -> dict: ...

    def deregister(self, instance_id: str) -> dict: ...

    def lease(self, instance_id: str, max_tasks: int, wait_s: float = 0.0) -> list[Task]: ...

    def push(self, instance_id: str, task_id: str, samples: list) -> dict: ...

    def push_many(self, instance_id: str,
                  items: list[tuple[str, list[Sample]]]) -> list[dict | Exception]: ...


class WeightSourceAPI(Protocol):
    """Where a RaaS gets the published weights."""

    def latest_manifest(self, model_id: str) -> WeightManifest | None: ...

    def manifest(self, model_id: str, version: int) -> WeightManifest: ...

    def download_weight_file(self, model_id: str, version: int, name: str) -> bytes: ...

    def download_weight_file_to(self, model_id: str, version: int, name: str,
                                path: str | Path) -> Path: ...


class TrainerAPI(Protocol):
    """A trainer's datamodule: batches in, acknowledgements out, keep-alives in between."""

    #: the service's ``batch_ack_timeout_s`` as the last pull said (None: not known yet)
    batch_ack_timeout_s: float | None

    def pull_batch(self, model_id: str, size: int, timeout_s: float = 30.0,
                   trainer_id: str | None = None) -> Batch | None: ...

    def ack(self, batch_id: str, wait_s: float | None = None, step_s: float | None = None,
            step: int | None = None) -> dict: ...

    def trainer_resumed(self, model_id: str, step: int) -> dict: ...

    def extend_batch(self, batch_id: str) -> dict: ...


class PublisherAPI(Protocol):
    """A trainer's weight publisher."""

    def current_version(self, model_id: str) -> int: ...

    def upload_weight_file(self, model_id: str, version: int, name: str, data: bytes) -> None: ...

    def publish(self, manifest: WeightManifest) -> dict: ...


class DataflowAPI(ObserverAPI, EvalAPI, MembershipAPI, WeightSourceAPI, TrainerAPI,
                  PublisherAPI, Protocol):
    """Everything the components call on a dataflow client."""

    def close(self) -> None: ...


#: the parts of the contract, one per caller
PARTS: tuple[type, ...] = (ObserverAPI, EvalAPI, MembershipAPI, WeightSourceAPI, TrainerAPI,
                           PublisherAPI)

#: every scripted fake -> the parts it implements whole (other methods it has with a contract
#: name must still take the contract's parameters)
FAKES: dict[type, tuple[type, ...]] = {}


def dataflow_fake(*parts: type) -> Callable[[type], type]:
    """Register a scripted fake of the dataflow client, implementing ``parts`` whole."""
    def register(cls: type) -> type:
        FAKES[cls] = parts
        return cls

    return register


def contract_methods(*protocols: type) -> list[str]:
    """The method names ``protocols`` declare, in declaration order (attributes left out)."""
    names: list[str] = []
    for proto in protocols:
        for klass in reversed(proto.__mro__):
            if klass.__module__ != __name__:
                continue
            names += [name for name, value in vars(klass).items()
                      if callable(value) and not name.startswith("_") and name not in names]
    return names


def wire_error(exc: ServiceError | ProtocolError) -> DataflowError:
    """The :class:`DataflowError` a client raises for the route's answer to ``exc`` (the app's
    handlers: a ServiceError's status, a ProtocolError's 422, ``{"error", "field"}``)."""
    status = exc.status if isinstance(exc, ServiceError) else 422
    return DataflowError(status, str(exc), exc.field, {"error": str(exc), "field": exc.field})


@contextlib.contextmanager
def as_on_the_wire() -> Iterator[None]:
    """Refusals of the service raised as the client raises them."""
    try:
        yield
    except (ServiceError, ProtocolError) as exc:
        raise wire_error(exc) from None


def _msgpack(obj: Any) -> Any:
    """``obj`` after a msgpack round trip (dataclasses rebuilt, tuples as lists, copies)."""
    return decode(encode(obj))


def _json(obj: Any) -> Any:
    """``obj`` after the JSON routes' round trip (keys as strings, NaN refused)."""
    return json.loads(json.dumps(obj, allow_nan=False))


# ----------------------------------------------------------------------------- the real behaviour


class InProcessDataflow:
    """:class:`DataflowAPI` over a real core :class:`Dataflow`, without HTTP.

    Each method answers what :class:`~astralight.dataflow.client.DataflowClient` answers for the
    same call on a service of that core: the core's reply through the wire's encoding (msgpack or
    JSON, as the route uses), and the checks the routes make around the core that change what a
    component sees (the workflow check at registration, the issued ``instance_secret``, the
    ``batch_ack_timeout_s`` of a pull, the stats' client tables, a missing manifest's 404).
    Authentication, body limits and field validation are the app's
    (``tests/unit/test_dataflow_app.py``). :meth:`in_folder` makes one on a fresh SQLite state.
    """

    def __init__(self, flow: Dataflow, poll_s: float = 0.02):
        self.flow = flow
        self.poll_s = poll_s
        self.batch_ack_timeout_s: float | None = None

    @classmethod
    def in_folder(cls, folder: str | Path, **config: Any) -> "InProcessDataflow":
        """A fresh core in ``folder/state`` (``config``: :class:`DataflowConfig` fields)."""
        return cls(Dataflow(DataflowConfig(state_dir=str(Path(folder) / "state"), **config)))

    def close(self) -> None:
        self.flow.close()

    # ---------------------------------------------------------------- ObserverAPI

    def info(self) -> dict:
        return _json(self.flow.info())

    def stats(self) -> dict:
        out = self.flow.stats()
        out.update(clients={}, client_instances={}, clients_evicted=0)  # no HTTP clients
        return _json(out)

    def balance(self, model_id: str, window: int = 10, pool: int | None = None,
                last: int | None = None) -> dict:
        with as_on_the_wire():
            return _json(self.flow.balance(model_id, int(window), pool, last=last))

    def counters(self, model_id: str, since: int = 0) -> dict[int, dict[str, int]]:
        with as_on_the_wire():
            table = self.flow.version_counters(model_id, int(since))
        return {int(v): c for v, c in _json({str(v): c for v, c in table.items()}).items()}

    # ---------------------------------------------------------------- EvalAPI

    def eval_results(self, model_id: str) -> dict[int, dict]:
        with as_on_the_wire():
            results = self.flow.eval_results(model_id)
        return {int(v): r for v, r in _json({str(v): r for v, r in results.items()}).items()}

    def eval_completions(self, model_id: str, version: int,
                         limit: int | None = None) -> list[dict]:
        from astralight.dataflow.evals import COMPLETIONS_PER_VERSION

        with as_on_the_wire():
            rows = self.flow.eval_completions(model_id, int(version),
                                              COMPLETIONS_PER_VERSION if limit is None else limit)
        return _json(rows)

    def request_eval(self, model_id: str, version: int) -> dict:
        with as_on_the_wire():
            return _msgpack(self.flow.request_eval(model_id, int(version)))

    # ---------------------------------------------------------------- MembershipAPI

    def register(self, model_ids: list[str], capacity: int, instance_id: str | None = None,
                 meta: dict | None = None, capacity_units: float = 1.0,
                 limits: dict | None = None) -> dict:
        from astralight.dataflow.membership import check_workflow

        with as_on_the_wire():
            check_workflow(meta or {}, self.flow.config.workflow)
            reply = self.flow.register(list(model_ids), capacity, instance_id, meta or {},
                                       capacity_units=float(capacity_units), limits=limits or None)
        return _msgpack({**reply, "instance_secret": secrets.token_urlsafe(16)})

    def heartbeat(self, instance_id: str, in_flight: int | None = None,
                  stats: dict | None = None) -> dict:
        stats = {k: float(v) for k, v in stats.items()} if stats else None
        with as_on_the_wire():
            return _msgpack(self.flow.heartbeat(instance_id, in_flight, stats=stats))

    def drain(self, instance_id: str) -> dict:
        with as_on_the_wire():
            return _msgpack(self.flow.drain(instance_id))

    def return_tasks(self, instance_id: str, task_ids: list[str],
                     failed: bool = False) -> dict:
        with as_on_the_wire():
            return _msgpack(self.flow.return_tasks(instance_id, list(task_ids), bool(failed)))

    def deregister(self, instance_id: str) -> dict:
        with as_on_the_wire():
            return _msgpack(self.flow.deregister(instance_id))

    def lease(self, instance_id: str, max_tasks: int, wait_s: float = 0.0) -> list[Task]:
        """Answers at once (no long poll: the runner naps the rest of ``wait_s``)."""
        with as_on_the_wire():
            return _msgpack(self.flow.lease(instance_id, max_tasks))

    def push(self, instance_id: str, task_id: str, samples: list) -> dict:
        with as_on_the_wire():
            return _msgpack(self.flow.push(instance_id, task_id, _msgpack(list(samples))))

    def push_many(self, instance_id: str,
                  items: list[tuple[str, list[Sample]]]) -> list[dict | Exception]:
        if not items:
            return []
        items = [(task_id, _msgpack(list(samples))) for task_id, samples in items]
        with as_on_the_wire():
            replies = self.flow.push_many(instance_id, items)
        return [wire_error(r) if isinstance(r, ServiceError) else _msgpack(r) for r in replies]

    # ---------------------------------------------------------------- WeightSourceAPI

    def latest_manifest(self, model_id: str) -> WeightManifest | None:
        with as_on_the_wire():
            return _msgpack(self.flow.manifest(model_id, None))

    def manifest(self, model_id: str, version: int) -> WeightManifest:
        with as_on_the_wire():
            found = self.flow.manifest(model_id, int(version))
        if found is None:
            raise wire_error(ServiceError(404, "version", f"version {version} of {model_id!r} "
                                                          "is not published"))
        return _msgpack(found)

    def download_weight_file(self, model_id: str, version: int, name: str) -> bytes:
        """The file's bytes (the store checked their sha256 when the upload was committed; a
        test of damaged downloads uses :class:`FakeStore`'s ``corrupt``)."""
        if name not in self.manifest(model_id, version).files:
            raise DataflowError(404, f"{name!r} is not a file of {model_id} version {version}",
                                field="name")
        with as_on_the_wire():
            path, _ = self.flow.weight_file(model_id, int(version), name)
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            raise wire_error(ServiceError(410, "name", f"{name} of {model_id} v{version} is listed "
                                                       "in the manifest but missing")) from None

    def download_weight_file_to(self, model_id: str, version: int, name: str,
                                path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.download_weight_file(model_id, version, name))
        return path

    # ---------------------------------------------------------------- TrainerAPI

    def pull_batch(self, model_id: str, size: int, timeout_s: float = 30.0,
                   trainer_id: str | None = None) -> Batch | None:
        """Long-poll as the route does (up to ``max_pull_timeout_s``), every ``poll_s``."""
        timeout_s = min(max(0.0, float(timeout_s)), self.flow.config.max_pull_timeout_s)
        deadline = time.monotonic() + timeout_s
        with as_on_the_wire():
            self.flow.check_pull(model_id, size)
            while (batch := self.flow.pull(model_id, size, trainer_id)) is None \
                    and time.monotonic() < deadline:
                time.sleep(self.poll_s)
        self.batch_ack_timeout_s = float(self.flow.config.batch_ack_timeout_s)
        return _msgpack(batch)

    def ack(self, batch_id: str, wait_s: float | None = None, step_s: float | None = None,
            step: int | None = None) -> dict:
        timed = wait_s is not None and step_s is not None  # the client sends both or neither
        with as_on_the_wire():
            return _msgpack(self.flow.ack(batch_id, wait_s=float(wait_s) if timed else None,
                                          step_s=float(step_s) if timed else None,
                                          step=None if step is None else int(step)))

    def trainer_resumed(self, model_id: str, step: int) -> dict:
        with as_on_the_wire():
            return _msgpack(self.flow.trainer_resumed(model_id, int(step)))

    def extend_batch(self, batch_id: str) -> dict:
        with as_on_the_wire():
            return _msgpack(self.flow.extend_batch(batch_id))

    # ---------------------------------------------------------------- PublisherAPI

    def current_version(self, model_id: str) -> int:
        with as_on_the_wire():
            return int(self.flow.current_version(model_id))

    def upload_weight_file(self, model_id: str, version: int, name: str, data: bytes) -> None:
        """The upload route's steps: check, stream into a temp file, commit."""
        async def body():
            yield bytes(data)

        flow = self.flow
        with as_on_the_wire():
            flow.check_upload(model_id, int(version), name)
            if len(data) > flow.config.max_weight_file_bytes:
                raise ServiceError(413, "body", "weight file exceeds max_weight_file_bytes="
                                                f"{flow.config.max_weight_file_bytes}")
            tmp, sha, _ = asyncio.run(flow.weights.receive(
                model_id, int(version), name, body(), flow.config.max_weight_file_bytes))
            flow.commit_upload(tmp, model_id, int(version), name, sha)

    def publish(self, manifest: WeightManifest) -> dict:
        with as_on_the_wire():
            return _msgpack(self.flow.publish(_msgpack(manifest)))


class AppTransport:
    """A :class:`DataflowClient`'s transport through an in-process app's ``TestClient`` (which
    takes no per-request timeout), sending ``headers`` (e.g. the client's Authorization) with
    every request: the real routes and core, without a socket. See :func:`app_client`."""

    def __init__(self, http: Any, headers: dict | None = None):
        self.http, self.headers = http, dict(headers or {})

    def request(self, method, path, timeout=None, headers=None, **kw):
        return self.http.request(method, path, headers={**self.headers, **(headers or {})}, **kw)

    def stream(self, method, path, timeout=None, headers=None, **kw):
        return self.http.stream(method, path, headers={**self.headers, **(headers or {})}, **kw)

    def close(self) -> None:
        pass


def app_client(http: Any, url: str = "http://127.0.0.1", token: str | None = "") -> Any:
    """A real :class:`DataflowClient` (no retries) whose requests go to the ``TestClient``
    ``http`` (:class:`AppTransport`), with ``token``'s Authorization."""
    client = DataflowClient(url, token=token, retry_s=0)
    auth = client._http.headers.get("authorization")
    client._http.close()
    client._http = AppTransport(http, {"Authorization": auth} if auth else {})
    return client


# ----------------------------------------------------------------------------- trainers


@dataflow_fake(PublisherAPI)
class FakeDataflowClient:
    """A trainer's dataflow: synthetic batches, recorded acks and an in-memory weight store.

    Behaviour log-probs come from the tiny model at its initial weights (teacher-forced at the
    given temperature), so the first step is on-policy and later ones go progressively
    off-policy, as in a real run. Group rewards are random 0/1; advantages are GRPO
    group-normalised like the dataflow's. ``trainer``: set by a test to record the optimizer step
    at each ack (``acks``: ``(batch_id, step)``). ``group_rewards(batch_number, group_size)``
    replaces the random rewards (e.g. all groups solved: every advantage 0).
    """

    def __init__(self, model_dir, model_id: str = "policy", temperature: float = 1.0,
                 group_size: int = 2, seed: int = 0, logprob_noise: float = 0.0,
                 group_rewards=None):
        from astralight.trainer.hf_models import causal_lm_from_pretrained

        self.model = causal_lm_from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model_id = model_id
        self.temperature = temperature
        self.group_size = group_size
        self.logprob_noise = logprob_noise
        self.group_rewards = group_rewards
        self.rng = np.random.default_rng(seed)
        self.served: list[str] = []
        self.acks: list[tuple[str, int | None]] = []
        self.trainer = None
        self.closed = False
        # weight-store face
        self.lock = threading.Lock()
        self.uploads: list[tuple[int, str, bytes]] = []
        self.manifests = []
        self.version = 0

    def make_batch(self, size: int) -> Batch:
        from astralight.rl.advantages import group_normalized_advantages
        from astralight.rl.logprobs import causal_lm_logprobs

        samples = []
        n_groups = max(1, size // self.group_size)
        for g in range(n_groups):
            task_id = f"task-{len(self.served)}-{g}"
            rewards = self.rng.integers(0, 2, self.group_size).astype(float)
            if self.group_rewards is not None:
                rewards = np.asarray(self.group_rewards(len(self.served), self.group_size), float)
            for k in range(self.group_size):
                prompt_len = int(self.rng.integers(3, 6))
                gen_len = int(self.rng.integers(2, 7))
                prompt = self.rng.integers(3, 40, prompt_len)
                gen = np.append(self.rng.integers(3, 40, gen_len - 1), 1)  # ends with EOS
                ids = np.concatenate([[2], prompt, gen]).astype(np.int32)
                loss_mask = np.zeros(ids.shape[0], dtype=np.uint8)
                loss_mask[1 + prompt_len:] = 1
                with torch.no_grad():
                    lp = causal_lm_logprobs(self.model, torch.from_numpy(ids).long()[None],
                                            temperature=self.temperature)[0].numpy()
                logprobs = np.concatenate([[0.0], lp]).astype(np.float32)
                if self.logprob_noise:
                    logprobs = logprobs + self.rng.normal(0, self.logprob_noise,
                                                          logprobs.shape).astype(np.float32)
                logprobs = np.minimum(logprobs, 0.0) * loss_mask
                lag = int(self.rng.integers(0, 3))
                versions = np.where(loss_mask > 0, max(0, self.version - lag), -1).astype(np.int32)
                samples.append(Sample(
                    task_id=task_id, sample_index=k, model_id=self.model_id, token_ids=ids,
                    logprobs=logprobs.astype(np.float32), loss_mask=loss_mask, versions=versions,
                    reward=float(rewards[k]), prompt_len=1 + prompt_len,
                    metadata={"temperature": self.temperature, "finish_reason": "stop"}))
        adv = group_normalized_advantages(torch.tensor([s.reward for s in samples]),
                                          [s.task_id for s in samples])
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a
        return Batch(batch_id=f"batch-{len(self.served)}", model_id=self.model_id,
                     policy_version=self.version, samples=samples[:size])

    def pull_batch(self, model_id, size, timeout_s=30.0, trainer_id=None):
        assert model_id == self.model_id
        batch = self.make_batch(size)
        self.served.append(batch.batch_id)
        return batch

    def ack(self, batch_id, wait_s=None, step_s=None, step=None):
        step = self.trainer.global_step if self.trainer is not None else None
        self.acks.append((batch_id, step))

    def close(self):
        self.closed = True

    def current_version(self, model_id):
        return self.version

    def upload_weight_file(self, model_id, version, name, data):
        with self.lock:
            self.uploads.append((version, name, data))

    def publish(self, manifest):
        with self.lock:
            names = {(v, n) for v, n, _ in self.uploads}
            assert all((manifest.version, n) in names for n in manifest.files)
            self.manifests.append(manifest)
            self.version = max(self.version, manifest.version)
        return {"version": manifest.version}


@dataflow_fake()
class FakeKeepAliveClient:
    """``extend_batch`` answered from a script: ``fail`` maps batch ids to the error to raise;
    ``calls`` records every batch id asked for, ``called`` is set at the first."""

    def __init__(self):
        self.calls: list[str] = []
        self.fail: dict[str, Exception] = {}
        self.closed = False
        self.called = threading.Event()

    def extend_batch(self, batch_id):
        self.calls.append(batch_id)
        self.called.set()
        if batch_id in self.fail:
            raise self.fail[batch_id]
        return {"batch_id": batch_id, "extended": True}

    def close(self):
        self.closed = True


@dataflow_fake()
class FakeTrainerClient(FakeKeepAliveClient):
    """What the datamodule needs: pull_batch's ``batch_ack_timeout_s``, ack (answering
    ``ack_answer``, recording ``acks``) and extend_batch."""

    def __init__(self, timeout_s):
        super().__init__()
        self.batch_ack_timeout_s = timeout_s
        self.acks: list[str] = []
        self.ack_answer: dict = {"acked": True}

    def ack(self, batch_id, wait_s=None, step_s=None, step=None):
        self.acks.append(batch_id)
        return self.ack_answer


@dataflow_fake()
class RecordingClient:
    """Records acks (``(batch_id, step)``) and resume reports (``(model_id, step)``); a pull
    finds nothing."""

    def __init__(self):
        self.acks, self.resumes = [], []

    def ack(self, batch_id, wait_s=None, step_s=None, step=None):
        self.acks.append((batch_id, step))
        return {"acked": True}

    def trainer_resumed(self, model_id, step):
        self.resumes.append((model_id, step))
        return {"batches_rolled_back": 1, "samples_rolled_back": 4}

    def pull_batch(self, model_id, size, timeout_s=30.0, trainer_id=None):
        return None

    def close(self):
        pass


# ----------------------------------------------------------------------------- the RaaS


@dataflow_fake(WeightSourceAPI)
class FakeStore:
    """The weight half of DataflowClient, in memory (``add`` an artifact to publish it).
    ``corrupt`` names ``(version, file)`` always served damaged, ``corrupt_once`` once."""

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


class NotFound(Exception):
    """A 404 as the client raises it (``status``, ``field``)."""

    status = 404

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


@dataflow_fake(WeightSourceAPI)
class FakeDataflow(FakeStore):
    """Register / heartbeat / lease / push / return / deregister in memory (the membership
    half of DataflowClient's contract), plus FakeStore's weight routes.

    ``tasks`` are leased in order; every call is recorded. ``workflow``: the dataflow's
    ``workflow:`` setting; when set, a registration naming another workflow is refused as the
    real service refuses it (409 ``workflow``), registering nothing.
    """

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
        self.lease_waits = []  # the wait_s of every lease
        self.workflow = None

    def register(self, model_ids, capacity, instance_id=None, meta=None, capacity_units=1.0,
                 limits=None):
        self.register_metas.append(dict(meta or {}))
        if self.workflow is not None:
            from astralight.dataflow.membership import check_workflow

            with as_on_the_wire():
                check_workflow(meta or {}, self.workflow)
        self.registrations += 1
        self.register_calls.append((instance_id, capacity_units))
        self.registered_limits = limits  # the engines' limits of the last registration
        return {"instance_id": instance_id or "i0", "lease_seconds": 30.0}

    def heartbeat(self, instance_id, in_flight=None, stats=None):
        self.heartbeats.append(in_flight)
        self.heartbeat_stats.append(stats)
        return {"instance_id": instance_id, "lease_seconds": 30.0,
                "drain": self.drain_requested}

    def lease(self, instance_id, max_tasks, wait_s=0.0):
        self.lease_waits.append(wait_s)  # answered at once: the runner naps the rest
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


@dataflow_fake(WeightSourceAPI)
class BatchingDataflow(FakeDataflow):
    """A dataflow with ``push_many``: records how many tasks each push request carried
    (``batches``), safe for services pushing from several threads."""

    def __init__(self, tasks=()):
        super().__init__(tasks)
        self.lock = threading.Lock()
        self.batches = []

    def lease(self, instance_id, max_tasks, wait_s=0.0):
        with self.lock:
            return super().lease(instance_id, max_tasks, wait_s)

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


@dataflow_fake(WeightSourceAPI)
class RestartingDataflow(BatchingDataflow):
    """A dataflow that names its run and can be restarted on a fresh state.

    ``run_id`` is named in register and heartbeat answers and, as on
    :class:`~astralight.dataflow.client.DataflowClient` (the attribute its weight routes set),
    read by weight checks. :meth:`restart_fresh` is a restart on another ``state_dir``: a new run
    id, nothing published, new ``tasks`` (their ids may repeat the old run's, as ``train:N`` do),
    and no instance known (404 ``instance_id`` until it registers again). ``push_run_id`` is what
    the client's attribute is: the run a push names; a push naming another run is refused (409
    ``run_id``), as by the real route. ``accepted``: ``(run_id, task_id, samples)`` of every
    push accepted, in order.
    """

    def __init__(self, tasks=(), run_id="run-1"):
        super().__init__(tasks)
        self.run_id = run_id
        self.push_run_id = None
        self.known: set[str] = set()  # instances registered in this run
        self.accepted: list[tuple[str, str, list]] = []

    def restart_fresh(self, tasks=(), run_id="run-2"):
        with self.lock:
            self.run_id = run_id
            self.manifests, self.files = {}, {}
            self.known = set()
            self.tasks = list(tasks)

    def _check_known(self, instance_id):
        if instance_id not in self.known:
            raise NotFound(f"unknown instance {instance_id!r}", "instance_id")

    def register(self, model_ids, capacity, instance_id=None, meta=None, capacity_units=1.0,
                 limits=None):
        reply = super().register(model_ids, capacity, instance_id, meta, capacity_units, limits)
        with self.lock:
            self.known.add(reply["instance_id"])
            return {**reply, "run_id": self.run_id}

    def heartbeat(self, instance_id, in_flight=None, stats=None):
        self._check_known(instance_id)
        return {**super().heartbeat(instance_id, in_flight, stats), "run_id": self.run_id}

    def lease(self, instance_id, max_tasks, wait_s=0.0):
        self._check_known(instance_id)
        return super().lease(instance_id, max_tasks, wait_s)

    def push(self, instance_id, task_id, samples):
        self._check_known(instance_id)
        if self.push_run_id is not None and self.push_run_id != self.run_id:
            raise DataflowError(409, f"made for dataflow run {self.push_run_id!r}, this is "
                                     f"{self.run_id!r}", "run_id")
        reply = FakeDataflow.push(self, instance_id, task_id, samples)
        if not reply["duplicate"]:
            self.accepted.append((self.run_id, task_id, list(samples)))
        return reply

    def push_many(self, instance_id, items):
        with self.lock:
            self.batches.append(len(items))
            out = []
            for task_id, samples in items:
                try:
                    out.append(self.push(instance_id, task_id, samples))
                except Exception as exc:  # noqa: BLE001 - per-item outcome
                    out.append(exc)
            return out


@dataflow_fake(WeightSourceAPI)
class TakeoverDataflow(BatchingDataflow):
    """A dataflow on which this instance id can be taken over by another process: once
    ``taken_over`` is set, every call acting as the instance is refused as the real service
    refuses a wrong secret (403 ``instance_secret``) and counted in ``refused``."""

    def __init__(self, tasks=()):
        super().__init__(tasks)
        self.taken_over = False
        self.refused: list[str] = []  # the calls refused, by name

    def _check_secret(self, call: str):
        if self.taken_over:
            self.refused.append(call)
            raise DataflowError(403, "the X-Astralight-Instance-Secret header is not the secret "
                                     "this instance got at registration", "instance_secret")

    def heartbeat(self, instance_id, in_flight=None, stats=None):
        self._check_secret("heartbeat")
        return super().heartbeat(instance_id, in_flight, stats)

    def lease(self, instance_id, max_tasks, wait_s=0.0):
        self._check_secret("lease")
        return super().lease(instance_id, max_tasks, wait_s)

    def push_many(self, instance_id, items):
        self._check_secret("push_many")
        return super().push_many(instance_id, items)

    def return_tasks(self, instance_id, task_ids, failed=False):
        self._check_secret("return_tasks")
        return super().return_tasks(instance_id, task_ids, failed)

    def deregister(self, instance_id):
        self._check_secret("deregister")
        return super().deregister(instance_id)


# ----------------------------------------------------------------------------- monitors


@dataflow_fake(EvalAPI)
class FakeMonitorClient:
    """``stats`` and ``eval_results`` from dicts; ``eval_completions`` from ``completions``
    (``{version: rows}``; None: the route is missing, as on an older service: it raises);
    ``request_eval`` recorded and answered by ``on_request_eval(evals, version)`` (it may raise,
    or fill ``evals`` as the service would once the eval ran); ``info`` says evals run every
    ``eval_every`` versions."""

    def __init__(self, stats: dict, evals: dict | None = None, on_request_eval=None,
                 completions: dict | None = None, eval_every: int = 10):
        self._stats, self._evals = stats, evals if evals is not None else {}
        self.eval_every = eval_every
        self.eval_requests: list[tuple[str, int]] = []
        self._on_request_eval = on_request_eval
        self._completions = completions
        self.completion_calls: list[tuple[str, int, int | None]] = []

    def eval_completions(self, model_id: str, version: int, limit: int | None = None) -> list:
        self.completion_calls.append((model_id, version, limit))
        if self._completions is None:
            raise RuntimeError("404 Not Found: /v1/eval/policy/4/completions")
        return list(self._completions.get(version, []))[:limit]

    def info(self) -> dict:
        return {"eval": {"enabled": True, "every": self.eval_every}}

    def stats(self) -> dict:
        return self._stats

    def eval_results(self, model_id: str) -> dict:
        return self._evals

    def request_eval(self, model_id: str, version: int) -> dict:
        self.eval_requests.append((model_id, version))
        if self._on_request_eval is not None:
            self._on_request_eval(self._evals, version)
        return {"model_id": model_id, "version": version, "evals_scheduled": 1}


@dataflow_fake(EvalAPI)
class BalanceClient(FakeMonitorClient):
    """A :class:`FakeMonitorClient` whose ``balance`` answers a fixed report (a scale-up
    decision) and records ``(model_id, window)`` in ``calls``."""

    def __init__(self, stats: dict):
        super().__init__(stats)
        self.calls = []

    def balance(self, model_id: str, window: int = 10, pool: int | None = None,
                last: int | None = None) -> dict:
        self.calls.append((model_id, window))
        return {"wait_fraction": 0.25, "mean_step_s": 2.0, "mean_wait_s": 0.5, "produced": 100,
                "accepted": 90, "consumed": 64, "stale": 10,
                "decision": {"action": "scale_up", "pool": 4, "target": 6, "reason": "..."}}


# ----------------------------------------------------------------------------- the autoscaler


@dataflow_fake()
class FakeAutoscaleDataflow:
    """``stats`` and ``balance`` as the routes answer them: the test sets ``version``, the
    instance ``rows`` and ``next_report``; ``balance_calls`` and ``drained`` record the asks."""

    def __init__(self):
        self.version = 0
        self.rows: dict[str, dict] = {}
        self.next_report = None
        self.balance_calls: list[tuple] = []
        self.drained: list[str] = []

    def stats(self):
        return {"models": {"policy": {"current_version": self.version}},
                "instances": list(self.rows.values())}

    def balance(self, model_id, window=10, pool=None, last=None):
        self.balance_calls.append((model_id, window, pool))
        rep = dict(self.next_report)
        rep["instances"] = list(self.rows.values())
        return rep

    def drain(self, instance_id):
        self.drained.append(instance_id)


@dataflow_fake()
class FakeDrainClient:
    """An autoscaler backend's client: ``drain`` recorded (or, with ``fail``, refused as an
    unknown instance); ``closed`` counts closes."""

    def __init__(self, fail=False):
        self.drained, self.fail, self.closed = [], fail, 0

    def drain(self, instance_id):
        if self.fail:
            raise RuntimeError("dataflow HTTP 404: unknown instance")
        self.drained.append(instance_id)
        return {"instance_id": instance_id, "state": "draining", "in_flight": 0}

    def close(self):
        self.closed += 1


@dataflow_fake()
class FileDrainClient:
    """The drain route's effect, by file: ``DRAIN-<instance>`` appears in ``folder`` (a stand-in
    RaaS exits when it sees it); ``log`` records the instances drained."""

    def __init__(self, folder: Path, log: list):
        self.folder, self.log = folder, log

    def drain(self, instance_id):
        self.log.append(instance_id)
        (self.folder / f"DRAIN-{instance_id}").touch()

    def close(self):
        pass
