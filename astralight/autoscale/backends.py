"""How the autoscaler starts and stops rollout services: local processes or command templates.

A backend knows nothing of policy; the autoscaler tells it which instance to start or retire:

- :class:`LocalProcessBackend` (the default, and what ``astralight run`` uses): each instance is
  ``python -m astralight.cli raas serve --dataflow URL --config RAAS.yaml --instance_id ID`` on
  this machine, its output in ``LOG_DIR/ID.log``. Retiring drains it through the dataflow
  (``POST /v1/instances/{id}/drain``: no new leases; the RaaS sees ``drain`` in its heartbeat
  reply, finishes and pushes what it holds, returns the rest, deregisters and exits), then waits
  for the process; SIGTERM (the RaaS drains on it too) after ``drain_timeout_s``, SIGKILL
  ``kill_after_s`` later. Retirement runs in a thread, so the autoscaler keeps polling meanwhile.
  Children get SIGTERM if the autoscaler process dies, even by SIGKILL (Linux parent-death
  signal, :mod:`astralight.launch.proc`), so a killed autoscaler leaves no orphan RaaS behind; launches
  happen on the autoscaler's loop thread, which lives as long as the pool (the signal follows
  the forking *thread*). Instances it did not start (a restarted autoscaler adopting a previous
  one's, see :mod:`astralight.autoscale.service`) are not its children: :meth:`alive` cannot
  tell (None: ask the dataflow) and the autoscaler retires them through the drain route.
- :class:`CommandBackend`: shell command templates for a cluster (Slurm, kubectl, anything), with
  ``{instance}`` (the instance id) and ``{n}`` (instances wanted after the action) substituted::

      launch: "sbatch --job-name={instance} raas.sbatch {instance}"
      retire: "scancel --name={instance}"
      alive:  "squeue -h -n {instance} | grep -q ."          # optional; exit 0 = alive

  The launched job must start its RaaS with ``--instance_id {instance}`` so that the dataflow's
  table and the autoscaler agree on names. With a dataflow URL, retiring drains through the
  route first, then runs the retire command (scancel's SIGTERM drains a RaaS as well).
  The commands run with plain :mod:`subprocess`, without the parent-death signal: what they
  start belongs to the cluster and outlives the autoscaler on purpose; a restarted autoscaler
  adopts those instances instead of starting a second pool.

Instances are named ``auto-<k>`` by the autoscaler.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from astralight.dataflow.auth import ROLLOUT, handoff_env
from astralight.launch.proc import spawn

log = logging.getLogger("astralight.autoscale")


class BackendError(RuntimeError):
    """A backend could not start or stop an instance; the message says which and why."""


class Backend(Protocol):
    def launch(self, instance_id: str, n: int | None = None) -> Any:
        """Start instance ``instance_id`` (``n``: instances wanted after this launch)."""

    def retire(self, instance_id: str, n: int | None = None) -> None:
        """Drain and stop ``instance_id`` (may return before it has exited)."""

    def alive(self, instance_id: str) -> bool | None:
        """Whether it still runs; None when the backend cannot tell (ask the dataflow)."""

    def close(self) -> None:
        """Wait for retirements in progress; release resources."""


def drain_then_stop(instance_id: str, proc: Any, client_factory: Callable[[], Any],
                    drain_timeout_s: float, kill_after_s: float,
                    say: Callable[[str], None]) -> str:
    """Retire one running instance: ask the dataflow to drain it (it finishes its leased tasks,
    deregisters and exits), wait ``drain_timeout_s``, then SIGTERM, and ``kill_after_s`` later
    SIGKILL. ``proc`` is Popen-like (``poll``, ``wait(timeout)``, ``send_signal``, ``kill``: a
    local process or a Ray actor's handle). Returns how it stopped: ``drained``, ``SIGTERM`` or
    ``SIGKILL``."""
    how, drained = "drained", False
    if proc.poll() is None:
        client = None
        try:
            client = client_factory()
            client.drain(instance_id)
            drained = True
        except Exception as exc:  # e.g. 404: still starting, never registered
            say(f"{instance_id}: drain route failed ({exc}); stopping it with SIGTERM")
        finally:
            if client is not None and hasattr(client, "close"):
                client.close()
    try:
        proc.wait(timeout=drain_timeout_s if drained else 0)
    except subprocess.TimeoutExpired:
        how = "SIGTERM"
        if drained:
            say(f"{instance_id}: still running {drain_timeout_s:.0f}s after the drain request; "
                "SIGTERM")
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            how = "SIGKILL"
            say(f"{instance_id}: still running {kill_after_s:.0f}s after SIGTERM; SIGKILL")
            proc.kill()
            if proc.returncode is None:  # a Popen is reaped here; a Ray handle reaps in kill()
                proc.wait()
    return how


def render(template: str, instance_id: str, n: int | None) -> str:
    """Substitute ``{instance}`` and ``{n}`` (plain replacement: other braces stay as they are,
    e.g. a shell's ``${VAR}``)."""
    return template.replace("{instance}", instance_id).replace("{n}", "" if n is None else str(int(n)))


class LocalProcessBackend:
    """RaaS instances as child processes of this one (see the module docstring).

    ``env``: extra environment for the children; ``cpus``: CPU affinity of the children (default:
    inherited); ``client``: a DataflowClient-like object with ``drain(instance_id)`` (default: one
    per retirement, for ``dataflow_url``); ``say``: where event lines go (default: logging).
    """

    def __init__(self, raas_config: str | os.PathLike, dataflow_url: str, log_dir: str | os.PathLike,
                 env: dict | None = None, cpus: list[int] | None = None,
                 drain_timeout_s: float = 120.0, kill_after_s: float = 30.0,
                 client_factory: Callable[[], Any] | None = None,
                 say: Callable[[str], None] | None = None,
                 argv_prefix: list[str] | None = None):
        self.raas_config = Path(raas_config)
        if not self.raas_config.is_file():
            raise BackendError(f"raas_config: {self.raas_config} is not a file (the RaaS config "
                               f"every instance starts with)")
        if drain_timeout_s < 0 or kill_after_s < 0:
            raise BackendError("drain_timeout_s / kill_after_s: must be >= 0 seconds")
        self.dataflow_url = dataflow_url
        self.log_dir = Path(log_dir)
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.cpus = list(cpus) if cpus else None
        self.drain_timeout_s = float(drain_timeout_s)
        self.kill_after_s = float(kill_after_s)
        self.client_factory = client_factory or self._default_client
        self.say = say or log.info
        self.argv_prefix = argv_prefix or [sys.executable, "-m", "astralight.cli"]
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.retirements: dict[str, threading.Thread] = {}
        self.events: list[dict] = []  # what each retirement took: for the summary and tests
        self._lock = threading.Lock()

    def _default_client(self):
        from astralight.dataflow.client import DataflowClient

        return DataflowClient(self.dataflow_url, retry_s=10.0, timeout=10.0)

    def argv(self, instance_id: str) -> list[str]:
        return [*self.argv_prefix, "raas", "serve", "--dataflow", self.dataflow_url,
                "--config", str(self.raas_config), "--instance_id", instance_id]

    def launch(self, instance_id: str, n: int | None = None) -> subprocess.Popen:
        if instance_id in self.procs and self.procs[instance_id].poll() is None:
            raise BackendError(f"instance {instance_id} is already running "
                               f"(pid {self.procs[instance_id].pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{instance_id}.log"
        with open(log_path, "ab", buffering=0) as log_file:
            # dies with the autoscaler (astralight.launch.proc): a SIGKILLed autoscaler orphans no RaaS
            # with scoped tokens, each RaaS gets the rollout token (not the autoscaler's admin one)
            env = handoff_env({**os.environ, **self.env}, ROLLOUT)
            proc = spawn(self.argv(instance_id), cpus=self.cpus, stdout=log_file,
                         stderr=subprocess.STDOUT, env=env)
        self.procs[instance_id] = proc
        self.logs[instance_id] = log_path
        return proc

    def manages(self, instance_id: str) -> bool:
        """Whether ``instance_id`` is a child of this backend (what :meth:`retire` can stop)."""
        return instance_id in self.procs

    def alive(self, instance_id: str) -> bool | None:
        """Whether the child runs; None for an instance it did not start (ask the dataflow)."""
        proc = self.procs.get(instance_id)
        if proc is None:
            return None
        return proc.poll() is None

    def returncode(self, instance_id: str) -> int | None:
        proc = self.procs.get(instance_id)
        return None if proc is None else proc.poll()

    def retiring(self, instance_id: str) -> bool:
        thread = self.retirements.get(instance_id)
        return thread is not None and thread.is_alive()

    def retire(self, instance_id: str, n: int | None = None, wait: bool = False) -> None:
        """Drain ``instance_id`` and stop its process, in a thread (``wait``: join it)."""
        proc = self.procs.get(instance_id)
        if proc is None:
            raise BackendError(f"instance {instance_id} was not started by this backend")
        with self._lock:
            thread = self.retirements.get(instance_id)
            if thread is None or not thread.is_alive():
                thread = threading.Thread(target=self._retire, args=(instance_id, proc),
                                          name=f"retire-{instance_id}", daemon=True)
                self.retirements[instance_id] = thread
                thread.start()
        if wait:
            thread.join()

    def _retire(self, instance_id: str, proc: subprocess.Popen) -> None:
        t0 = time.monotonic()
        how = drain_then_stop(instance_id, proc, self.client_factory, self.drain_timeout_s,
                              self.kill_after_s, self.say)
        event = {"instance_id": instance_id, "how": how, "exit_code": proc.returncode,
                 "seconds": round(time.monotonic() - t0, 2)}
        with self._lock:
            self.events.append(event)
        self.say(f"{instance_id}: stopped ({how}, exit {proc.returncode}, "
                 f"{event['seconds']:.1f}s after retirement began)")

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for retirements in progress (``timeout_s``: at most that long in all), then stop
        any instance still running with SIGTERM / SIGKILL."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in list(self.retirements.values()):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for iid, proc in self.procs.items():
            if proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=self.kill_after_s)
                except subprocess.TimeoutExpired:
                    self._signal(proc, signal.SIGKILL)
                    proc.wait()


class CommandBackend:
    """Instances started and stopped by shell command templates (see the module docstring).

    ``launch`` / ``retire`` / ``alive``: templates with ``{instance}`` and ``{n}``; ``alive`` is
    optional (without it the autoscaler judges liveness from the dataflow's instance table).
    ``dataflow_url``: drain through the route before the retire command. A command that exits
    non-zero or runs past ``timeout_s`` raises BackendError with its output.
    """

    def __init__(self, launch: str, retire: str, alive: str | None = None,
                 dataflow_url: str | None = None, timeout_s: float = 120.0,
                 env: dict | None = None, cwd: str | os.PathLike | None = None,
                 client_factory: Callable[[], Any] | None = None,
                 say: Callable[[str], None] | None = None):
        for name, value in (("launch", launch), ("retire", retire)):
            if not isinstance(value, str) or not value.strip():
                raise BackendError(f"{name}: a command template is required, e.g. "
                                   f"'sbatch raas.sbatch {{instance}}' (got {value!r})")
        if alive is not None and (not isinstance(alive, str) or not alive.strip()):
            raise BackendError(f"alive: must be a command template or unset, got {alive!r}")
        self.templates = {"launch": launch, "retire": retire, "alive": alive}
        self.dataflow_url = dataflow_url
        self.timeout_s = float(timeout_s)
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.cwd = cwd
        self.client_factory = client_factory
        if client_factory is None and dataflow_url:
            self.client_factory = self._default_client
        self.say = say or log.info
        self.commands: list[str] = []  # every command run, in order (for logs and tests)

    def _default_client(self):
        from astralight.dataflow.client import DataflowClient

        return DataflowClient(self.dataflow_url, retry_s=10.0, timeout=10.0)

    def _run(self, what: str, instance_id: str, n: int | None) -> subprocess.CompletedProcess:
        cmd = render(self.templates[what], instance_id, n)
        self.commands.append(cmd)
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True,
                                  timeout=self.timeout_s, cwd=self.cwd,
                                  env={**os.environ, **self.env})
        except subprocess.TimeoutExpired as exc:
            raise BackendError(f"{what} command for {instance_id} ran past {self.timeout_s:.0f}s: "
                               f"{cmd}") from exc

    def _check(self, what: str, instance_id: str, n: int | None) -> str:
        out = self._run(what, instance_id, n)
        if out.returncode != 0:
            raise BackendError(f"{what} command for {instance_id} failed (exit {out.returncode}): "
                               f"{out.args}\n{(out.stderr or out.stdout).strip()[-2000:]}")
        return out.stdout

    def launch(self, instance_id: str, n: int | None = None) -> str:
        return self._check("launch", instance_id, n)

    def retire(self, instance_id: str, n: int | None = None) -> None:
        if self.client_factory is not None:
            client = None
            try:
                client = self.client_factory()
                client.drain(instance_id)
            except Exception as exc:
                self.say(f"{instance_id}: drain route failed ({exc}); running the retire command")
            finally:
                if client is not None and hasattr(client, "close"):
                    client.close()
        self._check("retire", instance_id, n)

    def manages(self, instance_id: str) -> bool:
        """Any instance id: the templates name instances, whoever launched them."""
        return True

    def alive(self, instance_id: str) -> bool | None:
        if self.templates["alive"] is None:
            return None
        return self._run("alive", instance_id, None).returncode == 0

    def close(self) -> None:
        pass
