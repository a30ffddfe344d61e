"""The agent worker: runs a user's agent function in another Python interpreter (its own
virtualenv), many episodes at once, driven over a JSON-lines pipe by
:mod:`astralight.workflows.agent_process`.

**Standard library only.** This file runs as a script (``python agent_runner.py AGENT``) in an
interpreter that has neither astralight nor vLLM installed, so it imports nothing else; it works
on Python 3.8 and later.

``AGENT`` names the function inside that interpreter: ``pkg.module:function``,
``pkg.module.function`` or ``path/to/file.py:function``. It is called as in-process
(``agent(task, base_url=..., api_key=..., model=..., **agent_kwargs)``); a plain ``def`` runs on a
daemon thread of its own per episode, an ``async def`` as a task on the worker's one event loop.

The protocol, one JSON object per line (never pickle):

- parent -> worker on stdin: ``{"op": "run", "id", "task", "base_url", "api_key", "model",
  "kwargs"}`` starts an episode; ``{"op": "cancel", "id"}`` cancels it (an async agent's task is
  cancelled; a thread cannot be stopped: it runs on, unobserved, and its model calls are refused
  by the endpoint, whose episode is closed by then). End of stdin: the worker exits at once
  (``os._exit``), so a hung agent never outlives the RaaS.
- worker -> parent on stdout: ``{"op": "ready", "agent", "async", "python", "pid"}`` once the
  agent imported, or ``{"op": "fatal", "error", "traceback"}`` when it did not (then it exits 3);
  per episode ``{"op": "done", "id", "answer"}`` (the answer as text: a string as is, None as
  "", anything else as JSON) or ``{"op": "error", "id", "type", "message", "traceback"}``; and
  ``{"op": "log", "id", "text"}`` for each line the episode wrote to ``sys.stdout`` /
  ``sys.stderr`` (print, logging, warnings), so the RaaS log names the episode.

The protocol owns the process's real stdin and stdout: the agent's file descriptor 1 is pointed at
stderr and descriptor 0 at ``/dev/null``, so nothing an agent (or a library, or a subprocess it
starts) prints can corrupt the pipe; what reaches descriptor 2 without going through
``sys.stderr`` is logged by the parent as the worker's, without an episode.
"""

import asyncio
import contextvars
import importlib
import importlib.util
import inspect
import io
import json
import os
import sys
import threading
import traceback

_EPISODE = contextvars.ContextVar("astralight_episode", default=None)
_OUT_LOCK = threading.Lock()
_PROTO_OUT = None  # the real stdout, owned by the protocol


def send(msg):
    """One protocol line to the parent (thread-safe)."""
    line = json.dumps(msg, ensure_ascii=False, default=str) + "\n"
    with _OUT_LOCK:
        _PROTO_OUT.write(line)
        _PROTO_OUT.flush()


class EpisodeStream(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` of the worker: an episode's lines go to the parent as
    ``log`` messages naming it; lines written outside an episode go to the real stderr."""

    def __init__(self, fallback):
        super().__init__()
        self.fallback = fallback
        self.partial = {}
        self.lock = threading.Lock()

    def writable(self):
        return True

    def write(self, text):
        episode = _EPISODE.get()
        if episode is None:
            self.fallback.write(text)
            self.fallback.flush()
            return len(text)
        with self.lock:
            buf = self.partial.get(episode, "") + text
            *lines, rest = buf.split("\n")
            self.partial[episode] = rest
        for line in lines:
            send({"op": "log", "id": episode, "text": line})
        return len(text)

    def flush_episode(self, episode):
        with self.lock:
            rest = self.partial.pop(episode, "")
        if rest:
            send({"op": "log", "id": episode, "text": rest})


def load_agent(spec):
    """The function named by ``spec`` (see the module docstring)."""
    if ":" in spec:
        module, _, name = spec.rpartition(":")
    else:
        module, _, name = spec.rpartition(".")
    if not module or not name:
        raise ValueError("expected pkg.module:function, pkg.module.function or "
                         "path/to/file.py:function, got %r" % spec)
    if module.endswith(".py"):
        path = os.path.abspath(module)
        loaded = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path)
        if loaded is None:
            raise ImportError("no Python file at %s" % path)
        mod = importlib.util.module_from_spec(loaded)
        sys.modules[loaded.name] = mod
        loaded.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    fn = getattr(mod, name, None)
    if fn is None:
        raise AttributeError("module %r has no attribute %r" % (module, name))
    if not callable(fn):
        raise TypeError("%r is a %s, not a function" % (spec, type(fn).__name__))
    return fn


def answer_text(value):
    """The agent's return value as the answer text (as in-process)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def is_async(fn):
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


class Worker:
    """Runs episodes as the parent asks; reports each one's end exactly once."""

    def __init__(self, agent, streams):
        self.agent = agent
        self.streams = streams
        self.async_agent = is_async(agent)
        self.loop = None
        self.tasks = {}  # id -> asyncio task (async agents)
        if self.async_agent:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="agent-loop",
                             daemon=True).start()

    def finish(self, episode, ok, value):
        for stream in self.streams:
            stream.flush_episode(episode)
        if ok:
            send({"op": "done", "id": episode, "answer": answer_text(value)})
        else:
            exc = value
            send({"op": "error", "id": episode, "type": type(exc).__name__,
                  "message": str(exc),
                  "traceback": "".join(traceback.format_exception(
                      type(exc), exc, exc.__traceback__))})

    def start(self, msg):
        episode = msg["id"]
        call_kwargs = dict(msg.get("kwargs") or {})
        call_kwargs.update(base_url=msg["base_url"], api_key=msg["api_key"],
                           model=msg["model"])
        if self.async_agent:
            def create():
                _EPISODE.set(episode)
                return self.loop.create_task(self.run_async(episode, msg["task"], call_kwargs))

            def schedule():
                self.tasks[episode] = contextvars.copy_context().run(create)

            self.loop.call_soon_threadsafe(schedule)
        else:
            threading.Thread(target=self.run_sync, args=(episode, msg["task"], call_kwargs),
                             name="agent-%s" % episode, daemon=True).start()

    def run_sync(self, episode, task, call_kwargs):
        _EPISODE.set(episode)
        try:
            out = self.agent(task, **call_kwargs)
            if inspect.isawaitable(out):  # a plain def returning a coroutine
                async def wait():
                    return await out

                out = asyncio.run(wait())
        except BaseException as exc:  # noqa: BLE001 - reported, SystemExit included
            self.finish(episode, False, exc)
        else:
            self.finish(episode, True, out)

    async def run_async(self, episode, task, call_kwargs):
        try:
            out = await self.agent(task, **call_kwargs)
        except asyncio.CancelledError:
            for stream in self.streams:
                stream.flush_episode(episode)
            return  # the parent cancelled it and no longer waits
        except BaseException as exc:  # noqa: BLE001 - reported, SystemExit included
            self.finish(episode, False, exc)
        else:
            self.finish(episode, True, out)
        finally:
            self.tasks.pop(episode, None)

    def cancel(self, episode):
        if self.async_agent:
            def do():
                task = self.tasks.pop(episode, None)
                if task is not None:
                    task.cancel()

            self.loop.call_soon_threadsafe(do)


def main(argv):
    global _PROTO_OUT
    if len(argv) != 2:
        sys.stderr.write("usage: agent_runner.py AGENT\n")
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]  # this folder (astralight's workflows) must not shadow the agent's modules
    # the protocol keeps the real stdin/stdout; the agent's fd 1 goes to stderr, fd 0 to nothing
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    _PROTO_OUT = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    real_err = sys.stderr
    streams = [EpisodeStream(real_err), EpisodeStream(real_err)]
    sys.stdout, sys.stderr = streams
    try:
        agent = load_agent(argv[1])
    except BaseException as exc:  # noqa: BLE001 - the parent reports it as a config error
        send({"op": "fatal", "error": "%s: %s" % (type(exc).__name__, exc),
              "traceback": traceback.format_exc()})
        return 3
    worker = Worker(agent, streams)
    send({"op": "ready", "agent": argv[1], "async": worker.async_agent,
          "python": sys.executable, "version": sys.version.split()[0], "pid": os.getpid()})
    for line in proto_in:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg.get("op") == "run":
            worker.start(msg)
        elif msg.get("op") == "cancel":
            worker.cancel(msg["id"])
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    try:
        if _PROTO_OUT is not None:
            _PROTO_OUT.flush()
    finally:
        os._exit(code)  # never wait for agent threads: a hung one must not keep the worker alive
