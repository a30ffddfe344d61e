"""Fault injection on a real run: the toy recipe's three processes on loopback, started by hand.

Shared by ``tests/benchmarks/bench_faults.py`` (the figures) and
``tests/integration/test_faults.py`` (the assertions). The components are started as a cluster
would start them (``python -m astralight.cli dataflow serve --config``, ``... raas serve
--dataflow URL --config``, ``... fit --config``) with the configs
:func:`astralight.launch.export_configs` writes from the recipe, not through the launcher, so the
harness decides when a process dies (``kill -9`` of its process group: the trainer's weight
encoder child dies with it, as on a lost machine) and how it comes back.

Scenarios (:data:`SCENARIOS`); the fault is injected once the dataflow's version reaches
``fault_at``:

* ``dataflow_kill``: kill -9 the dataflow, restart it at once on the same state_dir and port.
* ``raas_kill``: kill -9 the RaaS and start a new one (a new instance); the dead one's leases
  expire after ``lease_seconds`` and are re-issued.
* ``trainer_kill``: kill -9 the trainer once a ``last.ckpt`` exists and restart it with
  ``--ckpt_path <checkpoints>/last.ckpt``.
* ``partition``: the RaaS talks to the dataflow through :class:`astralight.netshape.ShapedProxy`;
  the link is cut (``partition_mode``) for ``partition_s``, longer than a heartbeat, then healed.
* ``disk_full``: the dataflow runs under ``unshare -rm`` with a ``disk_mb`` tmpfs mounted over
  its weight store (``state_dir/weights``); the harness fills that tmpfs (through
  ``/proc/PID/root``), keeps it full until ``disk_full_refusals`` weight uploads were refused
  (507), then frees it.
* ``state_disk_full``: the same over the whole ``state_dir`` (the SQLite state and the weight
  store), ``state_disk_mb``: filled until ``disk_full_refusals`` requests were refused with 507
  naming ``state_dir``, then freed. Every client retries those (nothing is stored, so nothing
  is lost); the dataflow logs the episode in two lines and no traceback. The tmpfs lives and
  dies with the dataflow's mount namespace, so its wrapper copies the state out when the
  dataflow exits (``dataflow-saved``: what the audit reads).
* ``garbage_raas``: a second "RaaS" registers, leases tasks and pushes malformed or mismatched
  samples (:func:`garbage_pushes`); every push must get a 4xx and store nothing. It never returns
  the tasks: their leases expire and the real RaaS runs them.
* ``dataflow_fresh_state``: kill -9 the dataflow and the trainer, start the dataflow on a new
  ``state_dir`` on the same port (a new run) and a fresh trainer; the RaaS keeps running. It
  must say that the dataflow's run changed and exit ``RUN_CHANGED_EXIT`` (it holds the old run's
  weights and the new run has published nothing: its v0 is the initial model); the harness then
  starts a new RaaS, as the launcher's supervisor would (:func:`restart_on_fresh_state`).
  ``cross_run_samples``: samples the new run accepted from the RaaS that held the old run's
  weights (must be 0); the old state's audit right after the kill is ``detail.old_run``.

After each: the trainer must exit 0 with the dataflow at the target version (``completed``), then
every component is stopped and :func:`astralight.dataflow.audit.audit` reads the state.

``recovery_s``: seconds from the moment the fault is cleared (the kill, which is followed by the
restart at once; the partition healed; the disk freed; the last garbage push answered) until all
three flows work again: the latest of the first sample stored by an accepted push, the first batch
acknowledged by the trainer and the first weight version published, each after that moment
(timestamps from the dataflow's own tables: ``samples.created``, ``batches.acked_at``,
``version_times.published_at``). ``recovery_push_s``, ``recovery_train_s`` and
``recovery_publish_s`` are the three parts.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np
import yaml

from astralight.launch import Component as LaunchComponent

SCENARIOS = ("dataflow_kill", "raas_kill", "trainer_kill", "partition", "disk_full",
             "dataflow_fresh_state",
             "garbage_raas", "state_disk_full")
PY = [sys.executable, "-m", "astralight.cli"]


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Settings:
    """What a scenario run looks like (the toy recipe, shortened)."""

    versions: int = 12            # trainer max_steps = the target version (WeightPublisher every 1)
    fault_at: int = 4             # inject once the dataflow's version reaches this
    batch_size: int = 64          # trainer batch (the recipe's 256 makes a version ~4x slower)
    lease_seconds: float = 15.0   # short, so a dead RaaS's tasks come back within the run
    batch_ack_timeout_s: float = 30.0
    ckpt_every: int = 2           # ModelCheckpoint every_n_train_steps (last.ckpt)
    partition_s: float = 10.0     # > a heartbeat (lease_seconds / 3)
    partition_mode: str = "refuse"
    disk_mb: int = 24             # tmpfs over the weight store (disk_full)
    disk_full_refusals: int = 3   # the disk stays full until this many uploads were refused
    state_disk_mb: int = 128      # tmpfs over the whole state_dir (state_disk_full)
    max_concurrency: int = 16     # RaaS tasks per lease cycle
    timeout_s: float = 360.0      # the whole scenario
    pin_cpus: bool = True         # the recipe's cpu_affinity (trainer and RaaS on their own core)
    garbage_skip: tuple = ()      # garbage cases left out (see garbage_cases)


class Component(LaunchComponent):
    """One child process (its own session, so kill -9 of the group takes its children too): the
    launcher's :class:`astralight.launch.Component` (start, stop, parent-death signal), plus a
    header line per start in its log and :meth:`kill9`, which the harness injects faults with."""

    def start(self) -> "Component":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"\n===== {time.strftime('%H:%M:%S')} start {' '.join(self.argv)}\n".encode())
        super().start()
        return self

    def kill9(self) -> None:
        """SIGKILL to the whole process group, then reap."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.alive()  # records the end of its lifetime

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


class ScenarioError(RuntimeError):
    """A scenario could not run to its end (the message says where and shows the logs)."""


class FaultRun:
    """The three components of one toy run in ``work``, under the harness's control."""

    def __init__(self, work: Path, model_dir: str | Path, settings: Settings,
                 recipe: Path | None = None):
        from astralight.launch import _default_recipe

        self.work = Path(work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.s = settings
        self.model_dir = str(model_dir)
        self.recipe_path = Path(recipe) if recipe else _default_recipe()
        self.recipe = yaml.safe_load(self.recipe_path.read_text())
        self.paths = {k: self.work / "configs" / f"{k}.yaml"
                      for k in ("dataflow", "raas", "trainer")}
        self.configure(free_port())
        self.state_dir = Path(self._cfg("dataflow")["state_dir"])
        self.db = self.state_dir / "dataflow.db"
        #: where a dataflow on a state tmpfs leaves a copy of its state when it exits
        self.saved_state = self.work / "dataflow-saved"
        self.ckpt_dir = self.work / "checkpoints" / "policy"
        self.dataflow: Component | None = None
        self.raas: Component | None = None
        self.trainer: Component | None = None
        self.retired: list[Component] = []  # killed components (their logs stay)
        self.trainer_error: str | None = None
        self._http = httpx.Client(timeout=5.0)
        self.cpus = self._affinity() if settings.pin_cpus else {}

    # ------------------------------------------------------------------ configs

    def configure(self, port: int) -> None:
        """Write the components' configs for a dataflow on ``port`` (before it first starts)."""
        from astralight.launch import export_configs

        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        export_configs(self.recipe_path, self.work / "configs", port=port,
                       run_dir=str(self.work), init_model=self.model_dir)
        self._patch_configs()

    def _cfg(self, name: str) -> dict:
        return yaml.safe_load(self.paths[name].read_text())

    def _patch_configs(self) -> None:
        """The recipe's configs, shortened: no held-out eval (eval tasks are not audited and cost
        rollouts), short leases and ack timeout, frequent last.ckpt, the run's versions."""
        s = self.s
        df = self._cfg("dataflow")
        df["eval"] = {"source": None}
        df.update(lease_seconds=s.lease_seconds, batch_ack_timeout_s=s.batch_ack_timeout_s,
                  weights_keep_s=0.0, log_level="INFO")
        df["state_dir"] = str(self.work / "dataflow")
        raas = self._cfg("raas")
        raas.update(max_concurrency=s.max_concurrency, progress_interval_s=5.0)
        tr = self._cfg("trainer")
        tr["trainer"]["max_steps"] = s.versions
        tr["data"]["init_args"]["batch_size"] = s.batch_size
        for cb in tr["trainer"]["callbacks"]:
            args = cb.setdefault("init_args", {})
            if cb["class_path"].endswith("ModelCheckpoint"):
                args.update(every_n_train_steps=s.ckpt_every, save_last=True,
                            dirpath=str(self.work / "checkpoints" / "policy"))
            if cb["class_path"].endswith("DataflowMonitor"):
                args["wait_final_eval_s"] = 0
        for name, data in (("dataflow", df), ("raas", raas), ("trainer", tr)):
            self.paths[name].write_text(yaml.safe_dump(data, sort_keys=False))

    def _affinity(self) -> dict[str, list[int]]:
        """The recipe's cpu_affinity where this machine has those CPUs (as the launcher does)."""
        have = os.sched_getaffinity(0)
        out = {}
        for kind, cpus in (self.recipe.get("cpu_affinity") or {}).items():
            wanted = {int(c) for c in cpus}
            if wanted and wanted <= have and len(have) > 1:
                out[kind] = sorted(wanted)
        return out

    def _env(self, kind: str) -> dict:
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        env.update({k: str(v) for k, v in ((self.recipe.get("env") or {}).get(kind) or {}).items()})
        if kind == "raas" and "raas" in self.cpus:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, self.cpus["raas"])))
        env.pop("ASTRALIGHT_TOKEN", None)
        return env

    # ------------------------------------------------------------------ components

    def start_dataflow(self, weights_tmpfs_mb: int | None = None,
                       first_start: bool = False, state_tmpfs_mb: int | None = None) -> Component:
        """Start (or restart, same state_dir and port) the dataflow; wait for its ready line.
        ``weights_tmpfs_mb``: run it under ``unshare -rm`` with a tmpfs of that size mounted over
        its weight store; ``state_tmpfs_mb``: the same over its whole state_dir
        (:func:`state_tmpfs_argv`)."""
        argv = PY + ["dataflow", "serve", "--config", str(self.paths["dataflow"])]
        if weights_tmpfs_mb:
            weights = self.state_dir / "weights"
            weights.mkdir(parents=True, exist_ok=True)
            script = (f"mount -t tmpfs -o size={int(weights_tmpfs_mb)}m astralight-faults "
                      f"{_sh(weights)} && exec " + " ".join(_sh(a) for a in argv))
            argv = ["unshare", "-rm", "sh", "-c", script]
        if state_tmpfs_mb:
            argv = state_tmpfs_argv(argv, self.state_dir, self.saved_state, state_tmpfs_mb)
        comp = Component("dataflow", argv, self.work / "logs" / "dataflow.log",
                         env=self._env("dataflow"), cpus=self.cpus.get("dataflow"))
        seen = comp.text().count("dataflow serving on http")
        comp.start()
        self.dataflow = comp
        try:
            self.wait(lambda: comp.text().count("dataflow serving on http") > seen, 60,
                      "the dataflow's ready line", comps=[comp])
        except ScenarioError:
            # the free port was taken by another process meanwhile: a new one, once, before
            # anything else started (a restart must keep its port, so it never retries)
            if (first_start and not comp.alive()
                    and "address already in use" in comp.text().lower()):
                log(f"port {self.port} taken meanwhile; configuring another")
                self.configure(free_port())
                return self.start_dataflow(weights_tmpfs_mb, first_start=False,
                                           state_tmpfs_mb=state_tmpfs_mb)
            raise
        return comp

    def start_raas(self, dataflow_url: str | None = None, name: str = "raas") -> Component:
        argv = PY + ["raas", "serve", "--dataflow", dataflow_url or self.url,
                     "--config", str(self.paths["raas"])]
        comp = Component(name, argv, self.work / "logs" / f"{name}.log", env=self._env("raas"),
                         cpus=self.cpus.get("raas"))
        comp.start()
        self.raas = comp
        return comp

    def start_trainer(self, ckpt_path: str | Path | None = None) -> Component:
        argv = PY + ["fit", "--config", str(self.paths["trainer"])]
        if ckpt_path is not None:
            argv += ["--ckpt_path", str(ckpt_path)]
        comp = Component("trainer", argv, self.work / "logs" / "trainer.log",
                         env=self._env("trainer"), cpus=self.cpus.get("trainer"))
        comp.start()
        self.trainer = comp
        return comp

    def start_all(self, raas_url=None, weights_tmpfs_mb: int | None = None,
                  state_tmpfs_mb: int | None = None) -> None:
        """Dataflow, then RaaS (at ``raas_url``: a URL, or a callable of the dataflow's port
        returning one, e.g. a proxy's), then trainer."""
        self.start_dataflow(weights_tmpfs_mb, first_start=True, state_tmpfs_mb=state_tmpfs_mb)
        self.start_raas(raas_url(self.port) if callable(raas_url) else raas_url)
        self.start_trainer()

    def use_state_dir(self, state_dir: Path) -> None:
        """Point the dataflow's config (and :attr:`db`, what is audited) at ``state_dir``: the
        next start is a new run on a fresh state."""
        df = self._cfg("dataflow")
        df["state_dir"] = str(state_dir)
        self.paths["dataflow"].write_text(yaml.safe_dump(df, sort_keys=False))
        self.state_dir = Path(state_dir)
        self.db = self.state_dir / "dataflow.db"

    def retire(self, comp: Component) -> None:
        comp.kill9()
        self.retired.append(comp)

    def components(self) -> list[Component]:
        return [c for c in (self.trainer, self.raas, self.dataflow) if c is not None]

    def close(self) -> None:
        """Stop whatever still runs: trainer (SIGINT), RaaS and dataflow (SIGTERM), else kill."""
        for comp in self.components():
            sig = signal.SIGINT if comp.name == "trainer" else signal.SIGTERM
            comp.stop(sig, timeout_s=30)
        for comp in self.retired:
            if comp.alive():
                comp.kill9()
        self._http.close()

    # ------------------------------------------------------------------ observation

    def stats(self) -> dict | None:
        try:
            return self._http.get(f"{self.url}/v1/stats").json()
        except Exception:
            return None

    def policy(self) -> dict:
        st = self.stats() or {}
        return (st.get("models") or {}).get("policy") or {}

    def version(self) -> int:
        return int(self.policy().get("current_version") or 0)

    def wait(self, cond: Callable[[], bool], timeout_s: float, what: str,
             comps: list[Component] | None = None, poll_s: float = 0.5) -> None:
        """Poll ``cond`` until true; fail naming ``what`` with the logs if a watched component
        dies (default: all current ones) or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if cond():
                return
            for comp in comps if comps is not None else self.components():
                if not comp.alive() and not (comp.name == "trainer" and comp.proc.returncode == 0):
                    raise ScenarioError(f"{comp.name} exited ({comp.proc.returncode}) while "
                                        f"waiting for {what}:\n{comp.tail()}")
            if time.monotonic() > deadline:
                raise ScenarioError(f"timed out after {timeout_s:.0f}s waiting for {what}\n"
                                    + self.log_tails())
            time.sleep(poll_s)

    def wait_version(self, version: int, timeout_s: float) -> None:
        # polled fast: a trainer training from a full buffer publishes versions tens of
        # milliseconds apart, so a slow poll injects the fault versions later than asked
        self.wait(lambda: self.version() >= version, timeout_s, f"version {version}", poll_s=0.05)

    def log_tails(self, lines: int = 25) -> str:
        return "\n".join(f"--- {c.name} ---\n{c.tail(lines)}" for c in self.components())

    def finish(self, timeout_s: float) -> dict:
        """Wait for the trainer to end; stop the RaaS and the dataflow cleanly. Returns
        ``{completed, trainer_rc, final_version}``."""
        trainer = self.trainer
        self.wait(lambda: not trainer.alive(), timeout_s, "the trainer to finish",
                  comps=[c for c in self.components() if c is not trainer])
        final = self.version()
        rc = trainer.proc.returncode
        if rc != 0:
            errors = [ln for ln in trainer.text().splitlines() if "Error" in ln]
            self.trainer_error = errors[-1][:300] if errors else trainer.tail(3)
        self.raas.stop(signal.SIGTERM, timeout_s=60)
        self.dataflow.stop(signal.SIGTERM, timeout_s=30)
        return {"completed": rc == 0 and final >= self.s.versions, "trainer_rc": rc,
                "final_version": final}

    # ------------------------------------------------------------------ after the run

    def audit(self) -> dict:
        from astralight.dataflow.audit import audit

        return audit(self.db)

    def counters(self, names=("tasks_reissued", "tasks_returned", "duplicates_ignored",
                              "batches_requeued", "samples_requeued", "stale_dropped")) -> dict:
        """A few of the dataflow's counters for ``policy`` (read-only), to show what happened."""
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            got = dict(conn.execute("SELECT name, value FROM counters WHERE model_id='policy'")
                       .fetchall())
        finally:
            conn.close()
        return {n: int(got.get(n, 0)) for n in names}

    def recovery(self, t_clear: float) -> dict:
        """Seconds from ``t_clear`` to the next accepted push, the next acked batch and the next
        published version (None where it never came); ``recovery_s`` is the latest of the three."""
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            firsts = {
                "recovery_push_s": "SELECT MIN(created) FROM samples WHERE created > ?",
                "recovery_train_s": "SELECT MIN(acked_at) FROM batches WHERE acked_at > ?",
                "recovery_publish_s": "SELECT MIN(published_at) FROM version_times"
                                      " WHERE published_at > ?"}
            out = {}
            for key, sql in firsts.items():
                t = conn.execute(sql, (t_clear,)).fetchone()[0]
                out[key] = None if t is None else round(t - t_clear, 2)
        finally:
            conn.close()
        parts = list(out.values())
        out["recovery_s"] = None if None in parts else max(parts)
        return out


def _sh(text) -> str:
    import shlex

    return shlex.quote(str(text))


# ---------------------------------------------------------------------- a new run


def _rows(db: Path, sql: str, *args) -> list:
    """Rows of a read-only query of a state's database."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def restart_on_fresh_state(run: FaultRun, timeout_s: float) -> tuple[float, dict]:
    """The ``dataflow_fresh_state`` fault: kill -9 the dataflow and the trainer (audit the old
    state as the kill left it), start the dataflow on a new ``state_dir`` (same port) and a fresh
    trainer, wait for the running RaaS to say the run changed and exit, then start a new RaaS
    (what the launcher's supervisor does). Returns the time the fault was cleared (the new
    dataflow up) and what was seen; ``run.db`` is the new state's afterwards."""
    from astralight.raas.membership import RUN_CHANGED_EXIT

    old_raas, old_db = run.raas, run.db
    run.retire(run.dataflow)
    run.retire(run.trainer)
    dead = run.audit()
    old_ids = [r[0] for r in _rows(old_db, "SELECT instance_id FROM instances")]
    run.use_state_dir(run.work / "dataflow-new-run")
    run.start_dataflow()
    t_clear = time.time()
    run.start_trainer()
    run.wait(lambda: not old_raas.alive(), timeout_s, "the RaaS to leave the old run",
             comps=[run.dataflow, run.trainer])
    said = [ln for ln in old_raas.text().splitlines() if "the dataflow's run changed" in ln]
    run.retired.append(old_raas)
    run.start_raas(name="raas-2")
    run_ids = [json.loads(_rows(db, "SELECT value FROM meta WHERE key='run_id'")[0][0])
               for db in (old_db, run.db)]
    return t_clear, {
        "old_run": {k: dead[k] for k in ("balanced", "samples_lost", "duplicates_trained",
                                         "samples_accepted", "samples_trained")},
        "run_ids": run_ids, "raas_exit": old_raas.proc.returncode,
        "raas_exit_expected": RUN_CHANGED_EXIT, "raas_said": said[-1][:300] if said else None,
        "old_instances": old_ids}


def cross_run_samples(db: Path, old_instances: list[str]) -> int:
    """Samples the run of ``db`` accepted from instances of the old run (the RaaS that held its
    weights rejoins under the same id): each would be the old run's weights trained as this
    run's."""
    if not old_instances:
        return 0
    marks = ",".join("?" * len(old_instances))
    return int(_rows(db, f"SELECT COALESCE(SUM(samples_pushed), 0) FROM instances "
                         f"WHERE instance_id IN ({marks})", *old_instances)[0][0])


# ---------------------------------------------------------------------- disk


def fill_disk(dataflow: Component, weights: Path, chunk: int = 1 << 20) -> Path:
    """Fill the tmpfs mounted over ``weights`` in ``dataflow``'s mount namespace (reached through
    ``/proc/PID/root``) with one file, to the last byte. Returns the file to delete."""
    inside = Path(f"/proc/{dataflow.pid}/root") / weights.relative_to("/")
    if not os.path.ismount(inside) and not _is_tmpfs(inside):
        raise ScenarioError(f"{inside} is not the dataflow's tmpfs")
    filler = inside / ".fault-filler"
    block = b"\0" * chunk
    with open(filler, "wb", buffering=0) as f:
        size = chunk
        while size >= 1:
            try:
                f.write(block[:size])
            except OSError:
                size //= 2  # top up the last partial block
    return filler


def _is_tmpfs(path: Path) -> bool:
    try:
        return os.statvfs(path).f_blocks > 0
    except OSError:
        return False


def state_tmpfs_argv(argv: list[str], state_dir: Path, saved: Path, mb: int) -> list[str]:
    """``argv`` (the dataflow's command) under ``unshare -rm`` with a tmpfs of ``mb`` MiB over
    its whole ``state_dir``. The tmpfs goes with the mount namespace, so the wrapper shell runs
    the dataflow as its child (SIGTERM / SIGINT passed on) and, once it exited, copies the
    state's database files to ``saved`` for the audit."""
    state_dir.mkdir(parents=True, exist_ok=True)
    script = (f"mount -t tmpfs -o size={int(mb)}m astralight-faults {_sh(state_dir)} || exit 1\n"
              f"{' '.join(_sh(a) for a in argv)} & pid=$!\n"
              "trap 'kill -TERM $pid' TERM; trap 'kill -INT $pid' INT\n"
              "wait $pid; while kill -0 $pid 2>/dev/null; do wait $pid; done\n"
              f"rm -rf {_sh(saved)} && mkdir -p {_sh(saved)} && "
              f"cp -a {_sh(state_dir)}/dataflow.* {_sh(saved)}/\n")
    return ["unshare", "-rm", "sh", "-c", script]


#: what the dataflow logs when a full state_dir starts refusing writes, and when the episode
#: ends (writes succeed again after a quiet spell, or the service closes)
STATE_FULL, STATE_BACK = "every write is refused with 507", "write(s) were refused with 507"


def refused_5xx(run: FaultRun) -> int:
    """5xx answers the dataflow gave so far, over every client (``/v1/stats``)."""
    clients = (run.stats() or {}).get("clients") or {}
    return sum(int(c.get("failures_5xx", 0)) for c in clients.values())


def state_outage(dataflow_log: str, clients: list[Component]) -> dict:
    """What a ``state_disk_full`` run logged: the dataflow's episode lines (one when the fault
    started, one when writes succeeded again with the count refused), its tracebacks and 500s,
    and each client's "cannot store anything" lines (one per episode each)."""
    import re

    lines = dataflow_log.splitlines()
    started = [ln for ln in lines if STATE_FULL in ln]
    ended = [ln for ln in lines if STATE_BACK in ln]
    counts = [re.search(r"(\d+) write\(s\) were refused", ln) for ln in ended]
    return {"episodes_started": len(started), "episodes_ended": len(ended),
            "state_refusals": sum(int(m.group(1)) for m in counts if m),
            "state_full_line": started[0].split(": ", 1)[-1][:300] if started else None,
            "tracebacks": dataflow_log.count("Traceback"),
            "answers_500": sum("-> 500" in ln for ln in lines),
            "clients_said": {c.name: sum("cannot store anything (507)" in ln
                                         for ln in c.text().splitlines()) for c in clients}}


# ---------------------------------------------------------------------- garbage


def _sample(task, i: int, vocab: int, version: int = 0, **over) -> Any:
    """A well-formed 6-token sample of ``task`` (prompt 2 tokens, 4 generated at version 0),
    with ``over`` replacing fields."""
    from astralight.protocol import Sample

    base = dict(task_id=task.task_id, sample_index=i, model_id="policy",
                token_ids=np.array([2, 10, 11, 12, 13, 1], np.int32),
                logprobs=np.array([0, 0, -0.5, -0.5, -0.5, -0.5], np.float32),
                loss_mask=np.array([0, 0, 1, 1, 1, 1], np.uint8),
                versions=np.array([-1, -1] + [version] * 4, np.int32), reward=1.0, prompt_len=2)
    base.update(over)
    return Sample(**base)


def garbage_cases(vocab: int, version: int = 0) -> dict[str, Callable[[Any, int], list]]:
    """Each a function ``(task, group) -> samples`` a broken or hostile RaaS might push for a task
    it leased, encoded with the real codec (which checks nothing on the way out). Bodies that are
    not even well-formed messages are sent raw, see :func:`garbage_pushes`."""
    f32, i32 = np.float32, np.int32

    def group(task, n, **over):
        return [_sample(task, i, vocab, version, **over) for i in range(n)]

    def one(task, i):
        return _sample(task, i, vocab, version)

    return {
        "wrong_model_id": lambda t, n: group(t, n, model_id="not-a-policy"),
        "wrong_task_id": lambda t, n: group(t, n, task_id=t.task_id + "-other"),
        "shape_mismatch": lambda t, n: group(t, n, logprobs=np.zeros(3, f32)),
        "nan_reward": lambda t, n: group(t, n, reward=float("nan")),
        "inf_reward": lambda t, n: group(t, n, reward=float("inf")),
        "nan_logprob": lambda t, n: group(t, n, logprobs=np.array([0, 0, np.nan, -1, -1, -1], f32)),
        "positive_logprob": lambda t, n: group(t, n, logprobs=np.array([0, 0, 5, 5, 5, 5], f32)),
        "token_out_of_vocab": lambda t, n: group(
            t, n, token_ids=np.array([2, 10, vocab + 7, 2 ** 30, 13, 1], i32)),
        "negative_token": lambda t, n: group(t, n, token_ids=np.array([2, 10, -3, 12, 13, 1], i32)),
        "loss_mask_not_binary": lambda t, n: group(t, n, loss_mask=np.array([0, 0, 1, 7, 1, 1],
                                                                            np.uint8)),
        "future_version": lambda t, n: group(
            t, n, versions=np.array([-1, -1, 10 ** 6, version, version, version], i32)),
        "duplicate_sample_index": lambda t, n: [one(t, 0) for _ in range(n)],
        "too_many_samples": lambda t, n: [one(t, i) for i in range(n * 64)],
        "empty": lambda t, n: [],
    }


def garbage_pushes(url: str, vocab: int, group_size: int, db: Path, version: int = 0,
                   skip: tuple[str, ...] = (), lease_timeout_s: float = 60.0) -> dict:
    """Register as a RaaS, lease one task per garbage case and push it; then raw bodies (not
    msgpack, not a map, a sample of the wrong type) on a task of its own.

    ``version``: the policy version the garbage claims to have generated with (the current one,
    so nothing is dropped as stale before it would be trained); ``skip``: case names left out.
    Returns ``{cases: {name: status}, refused, accepted_bad, stored_bad, task_ids, t_end}``:
    ``accepted_bad`` lists the cases answered 2xx, ``stored_bad`` the cases whose task has sample
    rows in the database right after (read-only), i.e. garbage that got queued.
    """
    from astralight.dataflow.client import DataflowClient
    from astralight.protocol import encode

    cases = {k: v for k, v in garbage_cases(vocab, version).items() if k not in skip}
    raw_cases = {"not_msgpack": b"\xc1\xc1 this is not msgpack",
                 "not_a_map": encode([1, 2, 3]),
                 "samples_not_a_list": encode({"instance_id": None, "task_id": None,
                                               "samples": "nope"}),
                 "sample_wrong_type": None}  # filled once a task id is known
    client = DataflowClient(url, retry_s=30.0)
    statuses: dict[str, int | None] = {}
    task_of: dict[str, str] = {}
    try:
        iid = client.register(["policy"], capacity=len(cases) + len(raw_cases),
                              instance_id="garbage-raas",
                              # (no workflow name: the dataflow refuses one that is not its
                              # own `workflow:`, and this client runs none)
                              meta={"role": "garbage"})["instance_id"]
        tasks: list = []
        deadline = time.monotonic() + lease_timeout_s
        while len(tasks) < len(cases) + 1 and time.monotonic() < deadline:
            tasks += client.lease(iid, len(cases) + 1 - len(tasks))
            if len(tasks) < len(cases) + 1:
                time.sleep(0.5)
        if len(tasks) < len(cases) + 1:
            raise ScenarioError(f"garbage RaaS leased only {len(tasks)} tasks")
        for (name, make), task in zip(cases.items(), tasks):
            task_of[name] = task.task_id
            body = {"instance_id": iid, "task_id": task.task_id,
                    "samples": make(task, group_size)}
            statuses[name] = _post(client, "/v1/push", encode(body))
        raw_task = tasks[len(cases)]
        raw_cases["samples_not_a_list"] = encode({"instance_id": iid, "task_id": raw_task.task_id,
                                                  "samples": "nope"})
        raw_cases["sample_wrong_type"] = encode({"instance_id": iid, "task_id": raw_task.task_id,
                                                 "samples": [{"task_id": raw_task.task_id,
                                                              "token_ids": "abc"}]})
        for name, body in raw_cases.items():
            task_of[name] = raw_task.task_id
            statuses[name] = _post(client, "/v1/push", body)
        t_end = time.time()
    finally:
        client.close()
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        stored = {name: conn.execute("SELECT COUNT(*) FROM samples WHERE task_id=?",
                                     (tid,)).fetchone()[0] for name, tid in task_of.items()}
    finally:
        conn.close()
    accepted = sorted(n for n, st in statuses.items() if st is not None and st < 400)
    return {"cases": statuses, "refused": sum(1 for st in statuses.values()
                                              if st is not None and 400 <= st < 500),
            "accepted_bad": accepted, "server_errors": sorted(
                n for n, st in statuses.items() if st is None or st >= 500),
            "stored_bad": sorted(n for n, k in stored.items() if k), "task_ids": task_of,
            "t_end": t_end}


def _post(client, path: str, body: bytes) -> int | None:
    """POST raw msgpack through the client's HTTP session; the status (None: no answer)."""
    try:
        resp = client._http.post(path, content=body,
                                 headers={"Content-Type": "application/msgpack"}, timeout=30)
    except httpx.HTTPError:
        return None
    return resp.status_code


def vocab_size(model_dir: str | Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["vocab_size"])


# ---------------------------------------------------------------------- scenarios


def run_scenario(name: str, work: Path, model_dir: str | Path, settings: Settings) -> dict:
    """Run one scenario end to end; return its figures (see the module docstring). Never raises
    for a failed scenario: ``completed`` is false and ``error`` says why."""
    if name not in SCENARIOS:
        raise ValueError(f"scenario: {name!r} is not one of {SCENARIOS}")
    t0 = time.time()
    run = FaultRun(Path(work) / name, model_dir, settings)
    if name == "state_disk_full":  # the state lives on a tmpfs: audited from the copy it leaves
        run.db = run.saved_state / "dataflow.db"
    out: dict[str, Any] = {"scenario": name, "completed": False}
    detail: dict[str, Any] = {}
    t_clear = None
    proxy = None
    try:
        s = settings
        raas_url = None
        if name == "partition":
            from astralight.netshape import ShapedProxy

            def raas_url(port: int) -> str:
                nonlocal proxy
                proxy = ShapedProxy(("127.0.0.1", port), mbit=10_000,
                                    max_lifetime_s=s.timeout_s + 120).start_in_thread()
                return proxy.url
        run.start_all(raas_url=raas_url,
                      weights_tmpfs_mb=s.disk_mb if name == "disk_full" else None,
                      state_tmpfs_mb=s.state_disk_mb if name == "state_disk_full" else None)
        log(f"{name}: components started in {run.work}")
        run.wait_version(s.fault_at, s.timeout_s)
        v_fault = run.version()
        log(f"{name}: version {v_fault}, injecting the fault")
        t_fault = time.time()
        if name == "dataflow_kill":
            run.retire(run.dataflow)
            t_clear = time.time()
            # the state a kill -9 left, before anything repairs it, must already balance
            dead = run.audit()
            detail["audit_after_kill"] = {k: dead[k] for k in (
                "balanced", "samples_lost", "duplicates_trained", "tasks_issued", "tasks")}
            run.start_dataflow()
        elif name == "raas_kill":
            run.retire(run.raas)
            t_clear = time.time()
            run.start_raas(name="raas-2")
        elif name == "trainer_kill":
            # kill one step past a checkpoint, so the restart rolls back and must skip the
            # version the dataflow already holds
            # (and two versions before the target at most: a trainer step takes a fraction of a
            # second here, so a kill at the last version could land after the run's end, leaving
            # nothing to recover; measured once: killed at version 8 of 8). SIGSTOP the whole
            # group the moment the condition holds, so the version read next is the one killed.
            # A trainer that trains from a full buffer publishes a version every few tens of
            # milliseconds, shorter than a poll: so once the version is in range the whole group
            # is stopped first and the version read while it cannot move; at a version on a
            # checkpoint it is continued and polled again.
            last = run.ckpt_dir / "last.ckpt"
            group = run.trainer.proc.pid

            def in_range(v: int) -> bool:
                return last.exists() and s.fault_at <= v <= s.versions - 2

            def stopped_just_past_a_checkpoint() -> bool:
                if not run.trainer.alive():
                    raise ScenarioError(f"the trainer finished (version {run.version()}) before "
                                        "it was seen one step past a checkpoint")
                if not in_range(run.version()):
                    return False
                os.killpg(group, signal.SIGSTOP)
                time.sleep(0.2)  # a publication already sent lands
                v = run.version()
                if in_range(v) and v % s.ckpt_every == 1 % s.ckpt_every:
                    return True
                os.killpg(group, signal.SIGCONT)
                return False

            run.wait(stopped_just_past_a_checkpoint, s.timeout_s,
                     "a last.ckpt and a version just past a checkpoint", poll_s=0.02)
            detail["killed_at_version"] = run.version()
            run.retire(run.trainer)
            t_clear = time.time()
            run.start_trainer(ckpt_path=last)
        elif name == "partition":
            hb = s.lease_seconds / 3.0
            proxy.partition(s.partition_s, mode=s.partition_mode)
            time.sleep(s.partition_s)
            t_clear = time.time()
            detail.update(heartbeat_s=round(hb, 1), partition_s=s.partition_s,
                          partition_mode=s.partition_mode, link=proxy.stats.as_dict())
        elif name == "disk_full":
            filler = fill_disk(run.dataflow, run.state_dir / "weights")
            v_full = run.version()
            mark = run.dataflow.text().count("-> 507")
            # full until that many versions were refused (counted in versions, not seconds, so
            # the trainer, which does not wait for publication, still has steps to go after)
            run.wait(lambda: run.dataflow.text().count("-> 507") >= mark + s.disk_full_refusals,
                     s.timeout_s, f"{s.disk_full_refusals} uploads refused with 507", poll_s=0.1)
            refused = [ln for ln in run.dataflow.text().splitlines() if "-> 507" in ln]
            detail.update(version_when_full=v_full, version_when_freed=run.version(),
                          uploads_refused=len(refused) - mark,
                          refusal=refused[-1].split(" -> ", 1)[-1][:240] if refused else None,
                          other_upload_errors=sum("PUT /v1/weights" in ln and "-> 500" in ln
                                                  for ln in run.dataflow.text().splitlines()))
            filler.unlink()
            t_clear = time.time()
        elif name == "dataflow_fresh_state":
            t_clear, seen = restart_on_fresh_state(run, s.timeout_s)
            detail.update(seen)
        elif name == "state_disk_full":
            filler = fill_disk(run.dataflow, run.state_dir)
            mark = refused_5xx(run)
            # full until the dataflow said so and refused that many requests (clients retry them)
            run.wait(lambda: STATE_FULL in run.dataflow.text()
                     and refused_5xx(run) >= mark + s.disk_full_refusals, s.timeout_s,
                     f"{s.disk_full_refusals} requests refused with 507 naming state_dir",
                     poll_s=0.1)
            detail.update(version_when_full=run.version(), refused_5xx=refused_5xx(run) - mark)
            filler.unlink()
            t_clear = time.time()
        elif name == "garbage_raas":
            g = garbage_pushes(run.url, vocab_size(model_dir), run._cfg("dataflow")["group_size"],
                               run.db, version=run.version(), skip=s.garbage_skip)
            t_clear = g.pop("t_end")
            detail.update(g)
        out["fault_s"] = round(t_clear - t_fault, 2)
        detail["version_at_fault"] = v_fault
        if run.version() >= s.versions:
            raise ScenarioError(
                f"the run reached its target version {s.versions} before the fault was cleared "
                f"(injected at version {v_fault}; the trainer trained what was queued): nothing "
                "was left to recover; inject it earlier (fault_at) or run more versions")
        log(f"{name}: fault cleared after {out['fault_s']}s; waiting for version {s.versions}")
        out.update(run.finish(max(30.0, s.timeout_s - (time.time() - t0))))
        if name == "state_disk_full":
            detail.update(state_outage(run.dataflow.text(), [run.raas, run.trainer]))
        if name == "disk_full":  # publication resumed once the disk had room again
            detail["published_after_free"] = out["final_version"] > detail["version_when_freed"]
            detail["trainer_publish_errors"] = sum(  # what the trainer's publisher logged
                "publishing version" in ln and "failed" in ln
                for ln in run.trainer.text().splitlines())
        if name == "trainer_kill":
            skipped = [ln for ln in run.trainer.text().splitlines() if "not published again" in ln]
            detail["publisher_skip"] = skipped[-1].split("WARNING", 1)[-1].strip()[:200] \
                if skipped else None
    except ScenarioError as exc:
        out["error"] = str(exc)[-3000:]
        log(f"{name}: FAILED: {str(exc)[:3000]}")
    finally:
        run.close()
        if proxy is not None:
            proxy.close()
    try:
        report = run.audit()
        out.update({k: report[k] for k in ("tasks_issued", "samples_accepted", "samples_trained",
                                           "samples_lost", "duplicates_trained",
                                           "samples_rolled_back", "balanced")})
        out["audit"] = {k: report[k] for k in ("tasks", "tasks_pending", "samples_filtered",
                                               "samples_stale", "samples_pending", "batches",
                                               "mismatches")}
    except Exception as exc:  # no database at all
        out["audit_error"] = f"{type(exc).__name__}: {exc}"
    if t_clear is not None and run.db.exists():
        out.update(run.recovery(t_clear))
    if run.trainer_error:
        detail["trainer_error"] = run.trainer_error
    if run.db.exists():
        detail["counters"] = run.counters()
    if "old_instances" in detail and run.db.exists():  # (dataflow_fresh_state)
        out["cross_run_samples"] = cross_run_samples(run.db, detail["old_instances"])
    out["detail"] = detail
    out["wall_s"] = round(time.time() - t0, 1)
    out["work"] = str(run.work)
    return out


def prepare_model(out_dir: Path, sft_steps: int | None = None) -> Path:
    """The model every scenario starts from, built once into ``out_dir`` (reused if there): the
    toy recipe's ``prepare`` step (its warm start) with ``sft_steps`` (None: the recipe's; 0: the
    random tiny model, which is all a fault test needs)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    if sft_steps == 0:
        from astralight.trainer.tinymodel import build_tiny_model_folder

        return Path(build_tiny_model_folder(out_dir))
    import importlib

    from astralight.launch import _default_recipe

    prep = yaml.safe_load(_default_recipe().read_text())["prepare"]
    module, func = prep["function"].rsplit(".", 1)
    kwargs = dict(prep.get("kwargs") or {})
    if sft_steps is not None:
        kwargs["sft_steps"] = sft_steps
    kwargs.setdefault("num_threads", 1)  # two spinning OpenMP threads on a loaded 2-core host
    kwargs.setdefault("progress", False)
    getattr(importlib.import_module(module), func)(out_dir=str(out_dir), **kwargs)
    return out_dir


__all__ = ["SCENARIOS", "Settings", "FaultRun", "run_scenario", "garbage_pushes",
           "garbage_cases", "prepare_model", "fill_disk", "vocab_size"]
