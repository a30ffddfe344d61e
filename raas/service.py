"""The RaaS process: engines, membership, weight syncs and the episode runner, put together.

    astralight raas serve --dataflow http://127.0.0.1:8400 --config raas.yaml
    python -m astralight.raas.service --dataflow URL --config raas.yaml

:class:`RaaSService` registers with the dataflow (:mod:`astralight.raas.membership`: heartbeat,
drain, hard stop, rejoin), starts a :class:`~astralight.raas.weight_sync.WeightSync` per policy,
and runs the :class:`~astralight.raas.runner.EpisodeRunner` on an asyncio loop: every leased task
is its own episode, up to ``max_concurrency`` in flight, and the engines batch whatever the
episodes have in flight. The service decides nothing about data: which tasks exist, which
samples are trained on and what is stale belong to the dataflow.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from astralight.raas.config import RaaSConfig, build_engine, parse_config
from astralight.raas.membership import (HARD_STOP_CALLS_S, HARD_STOP_EXIT, RUN_CHANGED_EXIT,
                                        TAKEN_OVER_EXIT, Membership)
from astralight.raas.runner import Counters, EpisodeRunner
from astralight.raas.weight_sync import WeightSync
from astralight.launch.supervise import EXIT_USAGE

log = logging.getLogger("astralight.raas")


class RaaSService(Membership):
    """A rollout service instance. ``client_factory()`` returns a DataflowClient; ``engines``
    (``{model_id: Engine}``) may be passed in ready-made, else they are built from the config."""

    def __init__(self, config: RaaSConfig, client_factory: Callable[[], Any] | None = None,
                 engines: dict[str, Any] | None = None, out=None):
        self.config = config
        self.client_factory = client_factory or self._default_client_factory
        self.engines = engines
        self.out = out or sys.stdout
        self.counters = Counters()
        self.stop_event = threading.Event()
        self.client = None
        self.syncs: dict[str, WeightSync] = {}
        self._started = time.monotonic()
        self._last_progress = time.monotonic()
        self._tls = threading.local()
        self._push_clients: list = []
        self._clients_lock = threading.Lock()
        self._ready_at: float | None = None
        self._first_push_said = False
        self._exit = os._exit  # a hard stop ends the process; tests substitute a recorder
        self._init_membership()
        self.runner = EpisodeRunner(self)

    def _default_client_factory(self):
        from astralight.dataflow.client import DataflowClient

        return DataflowClient(self.config.dataflow, token=self.config.token)

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _on_stop(self, hard: bool = False) -> None:
        if hard:
            self.runner.cancel_all()
        self.runner.wake()

    def _on_run_change(self) -> None:
        self.runner.cancel_other_runs()
        self.runner.wake()

    # ------------------------------------------------------------------ start-up

    def start(self) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        if self.engines is None:
            self.engines = {}
            # the policies first (their seeds as before), then the frozen models: an engine not
            # in model_ids is served at its own weights and never synced (an agent team's judge)
            frozen = [m for m in cfg.engines if m not in cfg.model_ids]
            for i, mid in enumerate([*cfg.model_ids, *frozen]):
                self.engines[mid] = build_engine(mid, cfg.engines[mid], cfg.seed + i)
        engines_s = time.perf_counter() - t0
        self.client = self.client_factory()
        self.register()
        for mid in cfg.model_ids:
            sync = WeightSync(self.client_factory, mid, self.engines[mid],
                              check_interval_s=cfg.weight_check_interval_s,
                              background=cfg.background_weight_sync,
                              download_dir=cfg.weight_download_dir,
                              stream_min_bytes=cfg.weight_stream_min_bytes,
                              on_run=self.note_run)
            sync.follow_run(self.run_id)  # the run the registration named
            self.syncs[mid] = sync.start()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="raas-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        warm = sum(getattr(e, "warmup_s", 0.0) for e in self.engines.values())
        versions = " ".join(f"{m}=v{e.version}" for m, e in self.engines.items())
        self._ready_at = time.monotonic()
        self.say(f"raas ready instance={self.instance_id} model_ids={cfg.model_ids} {versions} "
                 f"engines_up_s={engines_s:.2f} warmup_s={warm:.2f} dataflow={cfg.dataflow}")

    # ------------------------------------------------------------------ running

    def serve(self) -> int:
        """Run the episode runner until stopped (signal, drain, ``max_cycles`` lease calls) and
        return the exit code: 0 after a clean finish or drain (then the instance leaves the
        pool), 1 when the dataflow was given up on, ``HARD_STOP_EXIT`` after a hard stop,
        ``TAKEN_OVER_EXIT`` when another process took the instance id over (nothing more is
        sent as it), ``RUN_CHANGED_EXIT`` when a new run of the dataflow needs the initial model
        back (the instance leaves the new run's pool first), ``EXIT_USAGE`` (2) when the
        workflow is broken (:class:`~astralight.workflows.base.BrokenWorkflowError`; it leaves
        the pool: a restart would fail the same way)."""
        code = asyncio.run(self.runner.serve())
        self.stop_event.set()
        if self._hard_stop.is_set():  # its own thread returns the tasks, deregisters and exits
            self._hard_stop_done.wait(HARD_STOP_CALLS_S + 1)
            self.maybe_progress(force=True)
            return HARD_STOP_EXIT
        self._stop_drain_threads()  # the drain is over: its timeout must not fire in the goodbye
        if self.taken_over:
            code = TAKEN_OVER_EXIT
        elif code in (0, RUN_CHANGED_EXIT, EXIT_USAGE):  # (a dataflow given up on would not answer)
            self.leave()
        self.maybe_progress(force=True)
        return code

    def run_cycle(self, client: Any = None) -> int:
        """One lease, its episodes run and pushed; the number of tasks pushed (tests, tools).
        ``client`` is accepted for compatibility and unused: pushes use per-thread clients."""
        return asyncio.run(self.runner.cycle_once())

    def _thread_client(self):
        client = getattr(self._tls, "client", None)
        if client is None:
            client = self._tls.client = self.client_factory()
            with self._clients_lock:
                self._push_clients.append(client)
        return client

    def first_push_said(self) -> None:
        if not self._first_push_said:
            self._first_push_said = True
            since = time.monotonic() - (self._ready_at or self._started)
            self.say(f"raas first push: lease {self.runner.leases} ({self.runner.leases_granted} "
                     f"with tasks), {since:.2f}s after ready")

    # ------------------------------------------------------------------ observation

    def engine_stats(self) -> dict:
        """Per-policy engine figures: weight pauses and requests spanning an update."""
        out = {}
        for mid, e in (self.engines or {}).items():
            out[mid] = {k: getattr(e, k) for k in (
                "weight_updates", "weight_pause_s_total", "weight_pause_s_last",
                "requests_spanning_update", "requests_restarted") if hasattr(e, k)}
        return out

    def progress_line(self) -> str:
        c = self.counters
        refreshes = sum(s.refreshes for s in self.syncs.values())
        pause = sum(s.pause_s_total for s in self.syncs.values())
        failures = sum(s.failures for s in self.syncs.values())
        fulls = sum(s.full_pulls for s in self.syncs.values())
        deltas = sum(s.delta_pulls for s in self.syncs.values())
        fallbacks = sum(s.full_fallbacks for s in self.syncs.values())
        wall = time.monotonic() - (self._ready_at or self._started)
        tok_s = c.tokens_generated / wall if wall > 0 else 0.0
        versions = " ".join(f"{m}=v{e.version}" for m, e in (self.engines or {}).items())
        spanning = sum(int(s.get("requests_spanning_update", 0))
                       for s in self.engine_stats().values())
        return (f"[raas {time.monotonic() - self._started:6.0f}s] leases {c.cycles}"
                f" | tasks {c.tasks_done} | samples {c.samples_pushed} (dup {c.duplicate_pushes})"
                f" | episodes {len(self.runner.episodes)} (peak {c.peak_in_flight})"
                f" | tok/s {tok_s:.0f} | refreshes {refreshes}"
                f" (weight_pause_s {pause:.2f}, spanning {spanning}, pulls full={fulls}"
                f" delta={deltas} full_fallbacks={fallbacks}) | {versions}"
                f" | errors wf={c.workflow_errors} push={c.push_errors}"
                f" dataflow={c.dataflow_errors} weights={failures}"
                f" empty={c.empty_tasks} unsupported={c.unsupported_tasks}"
                f" | pushes {c.push_requests} | returned {c.tasks_returned}"
                f" dropped {c.pushes_dropped} rejoins {c.rejoins} in_flight {self.in_flight_count()}"
                f" | run changes {c.run_changes} (cross-run dropped {c.cross_run_dropped})")

    def maybe_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= self.config.progress_interval_s:
            self._last_progress = now
            self.say(self.progress_line())

    def write_held_weights_report(self, path: str) -> dict:
        """Write what each engine holds (read back from the engine) next to what it should hold.

        JSON ``{model_id: {version, manifest_version, held: {name: sha256}, expected: {name:
        sha256}, mismatched: [names]}}``; ``expected`` are the checksums in the manifest of the
        shadow copy's version (the trainer's bf16 cast; for a float32 publication, those of the
        bf16 cast of the joined weights, :mod:`astralight.weights.exact`). Reading back costs
        about one forward pass per hidden size; it is meant for audits and tests, not for every
        refresh.
        """
        import json

        import torch

        from astralight.weights.bf16 import tensor_checksum
        from astralight.weights.exact import is_low_half, join_fp32

        report = {}
        for mid, engine in (self.engines or {}).items():
            sync = self.syncs.get(mid)
            if sync is not None:
                sync.apply_ready(wait=True)  # the engine on the newest verified version
            manifest = sync.state.manifest if sync is not None else None
            if manifest is not None and manifest.version != engine.version:
                manifest = None  # not what the engine holds: nothing to compare with
            entry: dict[str, Any] = {"version": int(engine.version),
                                     "manifest_version": manifest.version if manifest else None}
            held_fn, held = getattr(engine, "held_weights", None), None
            expected = None
            if manifest is not None:
                expected = {n: t["sha256"] for n, t in manifest.tensors.items()}
                if any(is_low_half(n) for n in expected):  # float32: compare the bf16 casts
                    expected = {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in
                                join_fp32(sync.state.tensors()).items()}
            if held_fn is None:
                entry["error"] = f"{type(engine).__name__} cannot report its weights"
            else:
                shapes = ({n: t["shape"] for n, t in manifest.tensors.items() if not is_low_half(n)}
                          if manifest else None)
                try:
                    held = held_fn(shapes)
                except Exception as exc:  # noqa: BLE001 - one engine's audit failing keeps the rest
                    entry["error"] = f"{type(exc).__name__}: {exc}"
            if held is not None:
                entry["held"] = {n: tensor_checksum(t) for n, t in held.items()}
                if expected is not None:
                    entry["expected"] = expected
                    entry["mismatched"] = sorted(n for n, sha in entry["expected"].items()
                                                 if entry["held"].get(n) != sha)
            if sync is not None:
                entry["sync"] = {**sync.stats(), "events": list(sync.events)}
            report[mid] = entry
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        for mid, entry in report.items():
            bad = entry.get("mismatched")
            self.say(f"raas held weights {mid} v{entry['version']}: "
                     + ("verified against the manifest" if bad == [] else
                        f"{len(bad)} tensors differ from the manifest" if bad else
                        entry.get("error", "no manifest to compare with")))
        return report

    def close(self) -> None:
        self.stop_event.set()
        self._heartbeat_stop.set()
        self._stop_drain_threads()
        for sync in self.syncs.values():
            sync.close()  # stops its thread; the shadow copy stays readable
        if self.config.held_weights_report and self.engines:
            try:
                self.write_held_weights_report(self.config.held_weights_report)
            except Exception:
                log.exception("could not write held_weights_report")
        self.runner.close()
        for client in self._push_clients:
            if client is not self.client:
                client.close()
        self._push_clients = []
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self.client is not None:
            self.client.close()
        for engine in (self.engines or {}).values():
            engine.close()


#: exit status of a RaaS whose configuration the dataflow refused at registration (the
#: launcher does not restart a component that exits 2: a restart would be refused again)
REFUSED_EXIT = 2
#: registration answers that are configuration errors: another workflow than the dataflow's
#: ``workflow:`` (409), a field the dataflow cannot accept (422: limits, model_ids)
REFUSED_STATUSES = (409, 422)


def _start(service: RaaSService) -> int | None:
    """``service.start()``; None when it joined the pool, else the exit status, said on one line:
    :data:`REFUSED_EXIT` when the dataflow refused the registration (its message names both
    values and the key to change), 1 when the dataflow never answered within
    ``dataflow_give_up_s``, 0 when a stop was asked for while waiting for it."""
    from astralight.dataflow.client import DataflowError, DataflowStopped, DataflowUnreachable

    url = service.config.dataflow
    try:
        service.start()
    except DataflowStopped as exc:
        service.say(f"raas stopped before joining the pool: {exc}")
        return 0
    except DataflowUnreachable as exc:
        service.say(f"raas giving up: {exc} (dataflow_give_up_s="
                    f"{service.config.dataflow_give_up_s:g}); is the dataflow running at "
                    f"--dataflow {url}?")
        return 1
    except DataflowError as exc:
        if exc.status not in REFUSED_STATUSES:
            raise
        service.say(f"raas: the dataflow at {url} refused this instance's registration: "
                    f"{exc.message}")
        return REFUSED_EXIT
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``astralight raas serve``; returns the process exit code."""
    # a crash inside torch or vLLM (SIGSEGV, SIGABRT) prints every thread's Python stack to
    # stderr, the component's log, instead of only the exit status
    faulthandler.enable()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat and lease
    try:
        config = parse_config(argv)
    except ValueError as exc:
        print(f"raas: bad configuration: {exc}", file=sys.stderr)
        return 2
    try:
        import torch

        if not torch.cuda.is_available():
            # measured on CPU: the in-process engine core starts in ~3 s instead of spawning
            # one (VLLMEngine runs vLLM's core in-process everywhere: its step driver needs it)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    except ImportError:  # pragma: no cover
        pass
    service = RaaSService(config)
    try:
        code = _start(service)
        if code is not None:
            return code
        signal.signal(signal.SIGTERM, service.request_stop)
        signal.signal(signal.SIGINT, service.request_stop)
        code = service.serve()
        service.say(f"raas exit {code}")
        return code
    finally:
        service.close()


if __name__ == "__main__":
    sys.exit(main())
