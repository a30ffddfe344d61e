"""Agents out of process: the user's agent runs in another Python interpreter (its own
virtualenv, with dependencies that cannot live beside vLLM: ``verifiers`` pins ``openai<3`` and
``mcp==2.0.0``), or as any command (a CLI harness), given only ``base_url``, ``api_key`` and
``model``; everything else is :class:`~astralight.workflows.openai_agent.OpenAIAgentWorkflow`'s
(recording, merging into samples, the reward, timeouts, ``failed_reward``, ``fail_fast``).

Two ways, one per workflow:

- ``agent: pkg.module:function`` (or ``pkg.module.function``, ``path/to/file.py:function``) with
  ``python: /path/to/venv/bin/python`` (default: this interpreter): one long-lived **worker**
  process (:mod:`astralight.workflows.agent_runner`, standard library only) imports the agent
  once and runs every episode inside it, a thread per plain ``def`` agent or a task on its one
  event loop per ``async def`` agent, driven over a JSON-lines pipe (:class:`AgentWorker`). An
  interpreter start and the agent's imports (seconds for a framework) are paid once, not per
  episode.
- ``command: [prog, arg, ...]``: one process per episode (:func:`run_command`). It gets
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``OPENAI_MODEL`` (also ``ASTRALIGHT_EPISODE``, the
  episode's name for its logs) in its environment and the task as one JSON object on stdin; what
  it prints on stdout (trailing whitespace removed) is the answer; a non-zero exit status is an
  agent error carrying its last stderr lines.

What the agent gets: the task dict of the in-process agent (``task_id``, ``prompt``,
``messages``, ``kind``, ``episode``) **without** ``metadata`` (it holds what the reward checks
against, and the reward is computed here, in the RaaS) unless ``send_metadata: true``; and
``agent_kwargs`` (JSON). Only JSON crosses the pipe, never pickle.

Episodes end as in-process: ``timeout_s`` cancels an ``async def`` agent's task and kills a
command's process group; a plain ``def`` agent's thread cannot be stopped, so it runs on (its
model calls are refused: its endpoint episode is closed), and after ``max_stuck_agents`` such
threads the worker is replaced (the old one ends once its other episodes have). An exception in
the agent is reported with its traceback text from the child and counted as an agent error
(``failed_reward``, ``fail_fast`` as in-process). What the agent prints (``sys.stdout``,
``sys.stderr``, logging) goes to the RaaS log, each line naming its episode. A worker that dies
fails the episodes it was running (``AgentWorkerDied``, with its exit status and last stderr
lines) and is restarted for the next ones; an agent that does not import, or a worker that dies
``max_worker_restarts`` times, stops the run (:class:`~astralight.workflows.base.
BrokenWorkflowError`) naming the fix. Children start in their own session and are killed when
the RaaS exits; a worker also exits by itself when its stdin closes (the RaaS died).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from astralight.engine import SamplingSpec
from astralight.rewards.base import Reward
from astralight.workflows.base import BrokenWorkflowError, blocking
from astralight.workflows.openai_agent import OpenAIAgentWorkflow

log = logging.getLogger(__name__)

#: the worker script, run by path in the agent's interpreter (standard library only)
RUNNER = Path(__file__).with_name("agent_runner.py")
#: stderr lines kept per worker / command for error messages
STDERR_TAIL = 20

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()  # processes to kill when the RaaS exits


def _kill_group(proc: Any) -> None:
    """SIGKILL a child started with ``start_new_session`` and whatever it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


@atexit.register
def _kill_live() -> None:
    for proc in list(_LIVE):
        _kill_group(proc)


class AgentProcessError(RuntimeError):
    """The agent failed in its own process: ``agent_error`` is its ``"Type: message"`` (what
    ``fail_fast`` compares and samples record), ``agent_traceback`` the child's traceback or
    last stderr lines (logged with the first error)."""

    def __init__(self, type_name: str, message: str, traceback: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.agent_error = f"{type_name}: {message}"
        self.agent_traceback = traceback


def check_python(python: str) -> str:
    """The interpreter's path, or a ValueError naming ``python`` and the fix."""
    python = os.path.expanduser(python)
    found = python if os.sep in python else shutil.which(python)
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        raise ValueError(
            f"python: {python!r} is not an executable Python interpreter; give the one of the "
            "agent's virtualenv, e.g. /path/to/venv/bin/python (make it with `python -m venv "
            "/path/to/venv && /path/to/venv/bin/pip install YOUR_DEPENDENCIES`), or leave "
            "python unset for this interpreter")
    return found


class AgentWorker:
    """One worker process (:mod:`~astralight.workflows.agent_runner`) and its pipe.

    Episodes are submitted from any event loop (:meth:`submit` returns a future of that loop);
    two daemon threads read the worker's stdout (protocol) and stderr (logged). Blocking:
    :meth:`start` (waits for the agent to import)."""

    def __init__(self, python: str, agent: str, env: dict[str, str] | None = None,
                 cwd: str | None = None, startup_timeout_s: float = 300.0):
        self.python, self.agent = python, agent
        self.env, self.cwd = env, cwd
        self.startup_timeout_s = float(startup_timeout_s)
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.fatal: dict | None = None
        self.ready = threading.Event()
        self.pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.lock = threading.Lock()
        self.stderr_tail: collections.deque = collections.deque(maxlen=STDERR_TAIL)
        self.stuck = 0  # episodes cancelled whose thread never reported back
        self.cancelled: set[str] = set()
        self.retired = False
        self.closing = False  # killed on purpose: its exit is no news
        self.exit_code: int | None = None

    # -- life

    def start(self) -> "AgentWorker":
        """Start the worker and wait until the agent imported; raise
        :class:`BrokenWorkflowError` (a config error) when it does not."""
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [self.python, "-u", str(RUNNER), self.agent], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env, cwd=self.cwd,
            start_new_session=True)
        _LIVE.add(self.proc)
        threading.Thread(target=self._read_stdout, name=f"agent-worker-{self.proc.pid}-out",
                         daemon=True).start()
        threading.Thread(target=self._read_stderr, name=f"agent-worker-{self.proc.pid}-err",
                         daemon=True).start()
        where = f"{self.agent!r} in {self.python}"
        if not self.ready.wait(self.startup_timeout_s):
            self.close()
            raise BrokenWorkflowError(
                f"agent: the agent worker for {where} did not start in startup_timeout_s="
                f"{self.startup_timeout_s:g} s; its last stderr lines: {self._tail()}")
        if self.fatal is not None:
            self.close()
            raise BrokenWorkflowError(
                f"agent: {where} does not load: {self.fatal['error']}; install what it needs "
                f"into that interpreter (`{self.python} -m pip install ...`) or put the folder "
                "of its module on the recipe's pythonpath (the worker inherits PYTHONPATH)\n"
                f"{self.fatal.get('traceback', '').rstrip()}")
        if not self.info:  # it exited before saying anything
            raise BrokenWorkflowError(
                f"agent: the agent worker for {where} exited with code {self.exit_code} before "
                f"it started; its last stderr lines: {self._tail()}")
        log.info("agent worker pid %d: %s (%s agent) in %s, Python %s, ready in %.1f s",
                 self.proc.pid, self.agent, "async" if self.info.get("async") else "plain",
                 self.python, self.info.get("version"), time.monotonic() - t0)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.exit_code is None and self.proc.poll() is None

    def close(self) -> None:
        """Kill the worker (and anything its agents started)."""
        self.closing = True
        if self.proc is not None:
            _kill_group(self.proc)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def retire(self) -> None:
        """Take no new episodes; end once the running ones have."""
        with self.lock:
            self.retired = True
            idle = not self.pending
        if idle:
            self.close()

    def _tail(self) -> str:
        return " | ".join(self.stderr_tail) or "(none)"

    # -- episodes

    def submit(self, episode: str, msg: dict) -> asyncio.Future:
        """Start an episode; the future (of the running loop) gets its answer text or an
        :class:`AgentProcessError`."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        line = (json.dumps({"op": "run", "id": episode, **msg}, ensure_ascii=False) + "\n")
        with self.lock:
            if not self.alive:
                raise self._died_error()
            self.pending[episode] = (loop, fut)
            try:
                self.proc.stdin.write(line.encode("utf-8"))
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.pending.pop(episode, None)
                raise self._died_error() from None
        return fut

    def cancel(self, episode: str) -> None:
        """The episode is no longer awaited (timeout): cancel it in the worker."""
        with self.lock:
            if self.pending.pop(episode, None) is None:
                return
            self.cancelled.add(episode)
            if not self.info.get("async"):
                self.stuck += 1  # a thread runs on until it reports back (if ever)
            try:
                self.proc.stdin.write((json.dumps({"op": "cancel", "id": episode}) + "\n")
                                      .encode("utf-8"))
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass
            idle = self.retired and not self.pending
        if idle:
            self.close()

    def _died_error(self) -> AgentProcessError:
        code = self.proc.poll() if self.proc is not None else None
        return AgentProcessError(
            "AgentWorkerDied", f"the agent worker (pid {getattr(self.proc, 'pid', '?')}, "
            f"{self.python}) exited with code {code}", f"its last stderr lines: {self._tail()}")

    def _settle(self, episode: str, ok: bool, value: Any) -> None:
        with self.lock:
            entry = self.pending.pop(episode, None)
            if entry is None and episode in self.cancelled:  # a stuck thread came back
                self.cancelled.discard(episode)
                if not self.info.get("async"):
                    self.stuck = max(0, self.stuck - 1)
            idle = self.retired and not self.pending
        if entry is not None:
            loop, fut = entry

            def settle() -> None:
                if not fut.done():
                    (fut.set_result if ok else fut.set_exception)(value)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # that loop is closed: nobody waits
                pass
        if idle:
            self.close()

    # -- the pipe

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw.decode("utf-8", errors="replace"))
            except ValueError:
                log.warning("agent worker pid %d: not a protocol line: %r", self.proc.pid,
                            raw[:200])
                continue
            op = msg.get("op")
            if op == "log":
                log.info("agent %s: %s", msg.get("id"), msg.get("text", ""))
            elif op == "done":
                self._settle(msg["id"], True, msg.get("answer", ""))
            elif op == "error":
                self._settle(msg["id"], False, AgentProcessError(
                    msg.get("type", "Exception"), msg.get("message", ""),
                    msg.get("traceback", "")))
            elif op == "ready":
                self.info = msg
                self.ready.set()
            elif op == "fatal":
                self.fatal = msg
                self.ready.set()
        # end of stdout: the worker exited
        self.exit_code = self.proc.wait()
        self.ready.set()
        with self.lock:
            orphans = list(self.pending)
        if self.info and not (self.retired or self.closing):
            log.warning("agent worker pid %d exited with code %s (%d episodes running); "
                            "its last stderr lines: %s", self.proc.pid, self.exit_code,
                            len(orphans), self._tail())
        for episode in orphans:
            self._settle(episode, False, self._died_error())

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.stderr_tail.append(line)
            log.info("agent worker pid %d: %s", self.proc.pid, line)


async def run_command(command: list[str], task: dict, base_url: str, api_key: str, model: str,
                      name: str, env: dict[str, str] | None = None,
                      cwd: str | None = None) -> str:
    """One episode of a command (a CLI harness): its stdout, or :class:`AgentProcessError`.
    Cancelling the awaiting task kills the command's process group."""
    child_env = dict(os.environ if env is None else env)
    child_env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=api_key, OPENAI_MODEL=model,
                     ASTRALIGHT_EPISODE=name)
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=child_env, cwd=cwd, start_new_session=True)
    except OSError as exc:
        raise AgentProcessError("CommandNotStarted", f"command {command[0]!r} could not be "
                                f"started: {exc}") from None
    _LIVE.add(proc)
    tail: collections.deque = collections.deque(maxlen=STDERR_TAIL)

    async def log_stderr() -> None:
        async for raw in proc.stderr:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            tail.append(line)
            log.info("agent %s: %s", name, line)

    async def feed() -> None:
        try:
            proc.stdin.write(json.dumps(task, ensure_ascii=False).encode("utf-8") + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it does not read its stdin

    try:
        _, out, _ = await asyncio.gather(feed(), proc.stdout.read(), log_stderr())
        code = await proc.wait()
    except BaseException:  # cancelled (timeout) or failed: nothing of it may run on
        _kill_group(proc)
        try:  # reaped here, so its pipes close on this loop, not after it
            await asyncio.wait_for(proc.wait(), 5)
        except BaseException:  # noqa: BLE001 - cancelled again or stuck: the kill stands
            pass
        raise
    if code != 0:
        raise AgentProcessError("CommandFailed", f"{shlex.join(command)} exited with code "
                                f"{code}", "its last stderr lines:\n" + "\n".join(tail))
    return out.decode("utf-8", errors="replace").rstrip()


class ProcessAgentWorkflow(OpenAIAgentWorkflow):
    """:class:`~astralight.workflows.openai_agent.OpenAIAgentWorkflow` with the agent out of
    process (see the module docstring): ``agent`` + ``python`` (a worker in that interpreter),
    or ``command`` (a process per episode). Its ``name`` is still ``openai_agent``.

    Args (besides those of OpenAIAgentWorkflow, which mean the same):
        agent: ``pkg.module:function`` (or ``pkg.module.function``, ``path/to/file.py:function``)
            imported inside ``python``; None with ``command``.
        python: the agent's interpreter (its virtualenv's ``bin/python``, ``~`` expanded;
            default: this one).
        command: a command run once per episode instead (a list, or one string split as a
            shell would): ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``OPENAI_MODEL`` in its
            environment, the task as JSON on stdin, the answer on stdout.
        env: extra environment variables for the agent's process.
        cwd: the agent's working directory (default: the RaaS's).
        send_metadata: also send the task's ``metadata`` (what the reward checks) to the agent.
        startup_timeout_s: most seconds for the worker to import the agent.
        max_stuck_agents: replace the worker after this many timed-out plain-``def`` episodes
            that still run in it.
        max_worker_restarts: a worker dying more often than this stops the run.
    """

    name = "openai_agent"

    def __init__(self, agent: str | None = None, reward: Reward | None = None,
                 python: str | None = None, command: list[str] | str | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 send_metadata: bool = False, startup_timeout_s: float = 300.0,
                 max_stuck_agents: int = 32, max_worker_restarts: int = 5,
                 sampling: SamplingSpec | None = None,
                 eval_sampling: SamplingSpec | None = None, force_sampling: bool = True,
                 timeout_s: float = 300.0, max_calls: int = 16,
                 max_context_tokens: int | None = None, system_prompt: str = "",
                 chat_template_kwargs: dict | None = None, merge: bool = True,
                 max_parallel_agents: int = 128, agent_kwargs: dict | None = None,
                 failed_reward: float | None = 0.0, fail_fast: int = 8,
                 role: str = "", endpoint: Any = None, team: list[str] | None = None,
                 agent_rewards: bool = False):
        if (agent is None) == (command is None):
            raise ValueError("agent / command: give exactly one: agent (pkg.module:function, "
                             "run in python's worker) or command (a program run per episode)")
        if isinstance(command, str):
            command = shlex.split(command)
        if command is not None and (not command or not all(isinstance(c, str) for c in command)):
            raise ValueError(f"command: expected a program and its arguments, got {command!r}")
        if command is not None and python is not None:
            raise ValueError("python: only for agent (the worker's interpreter); a command "
                             "names its own program")
        self.command = list(command) if command is not None else None
        self.python = check_python(python or sys.executable) if command is None else None
        for key, value in (env or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"env: names and values must be strings, got {key!r}: "
                                 f"{value!r}")
        self.env = dict(env or {})
        if cwd is not None and not os.path.isdir(cwd):
            raise ValueError(f"cwd: {cwd!r} is not a folder")
        self.cwd = cwd
        self.send_metadata = bool(send_metadata)
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s: must be > 0, got {startup_timeout_s}")
        self.startup_timeout_s = float(startup_timeout_s)
        if max_stuck_agents < 1 or max_worker_restarts < 0:
            raise ValueError("max_stuck_agents: must be >= 1; max_worker_restarts: >= 0")
        self.max_stuck_agents = int(max_stuck_agents)
        self.max_worker_restarts = int(max_worker_restarts)
        self._worker: AgentWorker | None = None
        self._worker_lock = threading.Lock()
        self._restarts = 0
        self._ids = itertools.count()
        super().__init__(agent=agent, reward=reward, sampling=sampling,
                         eval_sampling=eval_sampling, force_sampling=force_sampling,
                         timeout_s=timeout_s, max_calls=max_calls,
                         max_context_tokens=max_context_tokens, system_prompt=system_prompt,
                         chat_template_kwargs=chat_template_kwargs, merge=merge,
                         max_parallel_agents=max_parallel_agents, agent_kwargs=agent_kwargs,
                         failed_reward=failed_reward, fail_fast=fail_fast, role=role,
                         endpoint=endpoint, team=team, agent_rewards=agent_rewards)
        self.stats["worker_restarts"] = 0

    def _init_agent(self, agent: Any) -> Any:
        try:
            json.dumps(self.agent_kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"agent_kwargs: must be JSON (they are sent to the agent's "
                             f"process): {exc}") from None
        if agent is None:
            return None
        if not isinstance(agent, str) or not (":" in agent or "." in agent):
            raise ValueError(f"agent: out of process, name the function by import path inside "
                             f"python's interpreter (pkg.module:function), got {agent!r}")
        return agent

    def _child_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    # -- the worker

    def _usable(self) -> AgentWorker | None:
        """The current worker when it can take an episode now (no start, no wait)."""
        w = self._worker
        if w is not None and w.alive and not w.retired and w.stuck < self.max_stuck_agents:
            return w
        return None

    async def _worker_now(self) -> AgentWorker:
        """The worker, from the loop: at once when it runs, else started off the loop."""
        return self._usable() or await blocking(self.worker)

    def worker(self) -> AgentWorker:
        """The running worker, started (or restarted) when needed. Blocking."""
        with self._worker_lock:
            w = self._worker
            if w is not None and w.alive and not w.retired:
                if w.stuck < self.max_stuck_agents:
                    return w
                log.warning("agent worker pid %d: %d timed-out agents still run in it; "
                            "replacing it (it ends once its other episodes have)",
                            w.proc.pid, w.stuck)
                w.retire()
            elif w is not None and not w.alive:
                self._restarts += 1
                self.stats["worker_restarts"] = self._restarts
                if self._restarts > self.max_worker_restarts:
                    raise BrokenWorkflowError(
                        f"agent: the agent worker for {self.agent!r} ({self.python}) died "
                        f"{self._restarts} times (exit code {w.exit_code}; its last stderr "
                        f"lines: {w._tail()}); fix the agent, or raise max_worker_restarts")
                log.warning("agent worker pid %d died (exit code %s); starting another "
                            "(restart %d of at most %d)", w.proc.pid, w.exit_code,
                            self._restarts, self.max_worker_restarts)
            self._worker = AgentWorker(self.python, self.agent, env=self._child_env(),
                                       cwd=self.cwd,
                                       startup_timeout_s=self.startup_timeout_s).start()
            return self._worker

    def close(self) -> None:
        """Kill the worker (also done when the RaaS exits)."""
        with self._worker_lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    # -- episodes

    async def play(self, task: Any, messages: list[dict], engine: Any, model_id: str,
                   slot: int, others: dict[str, Any] | None = None) -> Any:
        if self.command is None:  # start the worker first: its imports are not the episode's
            await self._worker_now()
        return await super().play(task, messages, engine, model_id, slot, others=others)

    def _start_agent(self, view: dict, base_url: str, api_key: str, model: str,
                     name: str) -> Any:
        if not self.send_metadata:
            view = {k: v for k, v in view.items() if k != "metadata"}
        if self.command is not None:
            return run_command(self.command, view, base_url, api_key, model, name,
                               env=self._child_env(), cwd=self.cwd)
        return self._in_worker(view, base_url, api_key, model, f"{name}.{next(self._ids)}")

    async def _in_worker(self, view: dict, base_url: str, api_key: str, model: str,
                         episode: str) -> str:
        worker = await self._worker_now()
        fut = worker.submit(episode, {"task": view, "base_url": base_url, "api_key": api_key,
                                      "model": model, "kwargs": self.agent_kwargs})
        try:
            return await fut
        except asyncio.CancelledError:
            worker.cancel(episode)
            raise
