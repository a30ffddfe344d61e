"""Spawning long-lived children that die with their parent.

``astralight run``, ``astralight autoscale`` and the fault harness start services (dataflow, RaaS,
trainers) as child processes in sessions of their own (so a terminal's Ctrl-C reaches the parent
only, which stops them in order). A parent that is stopped politely (SIGTERM, SIGINT) stops its
children itself; a parent that is *SIGKILLed* (OOM killer, ``kill -9``, a scheduler) cannot, and
without help its children keep running: RaaS instances holding GPUs and still leasing tasks, a
trainer still publishing. :func:`spawn` (or :func:`child_setup` as a ``preexec_fn``) closes that
gap on Linux with the parent-death signal:

* In the child, between fork and exec, ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends the
  child SIGTERM when its parent dies, however it dies. SIGTERM, not SIGKILL, so the child stops as
  it would on any polite stop (a RaaS drains: returns its leases and deregisters; the dataflow
  commits), and a child that does nothing on SIGTERM still dies of it. The setting survives exec
  and is *not* inherited by the child's own children (each astralight service that spawns its own
  long-lived children uses this module too, or stops them on SIGTERM).
* The race: the parent may die after the fork and before ``prctl`` ran, and then no signal ever
  comes. So after ``prctl`` the child compares ``os.getppid()`` with the parent's pid taken before
  the fork, and exits at once (status :data:`ORPHANED_AT_START`) when they differ.

**The thread pitfall.** Linux sends the parent-death signal when the *thread* that forked the child
exits, not when the process does. A child spawned from a short-lived thread (a restart thread, a
request handler, a thread pool worker) gets SIGTERM as soon as that thread ends, while the parent
lives on. Spawn only from a thread that lives as long as the children should: astralight's
launcher and autoscaler spawn from the thread that runs their main loop (the main thread under the
CLI; retirement threads only wait and signal, they never spawn). :func:`spawn` with
``die_with_parent=True`` refuses to be called from a daemon thread other than the main thread
unless ``from_thread_ok=True`` says the caller knows that thread outlives the children.

Elsewhere (macOS, Windows) there is no parent-death signal: :func:`child_setup` only sets the CPU
affinity and :data:`PDEATHSIG_SUPPORTED` is False; a SIGKILLed parent there can still orphan its
children (stop them with the parent's process group, or a service manager).

Not for children meant to outlive the parent: commands that *submit* work elsewhere (``sbatch``,
``kubectl``, the autoscaler's command templates) are run with plain :mod:`subprocess`; what they
start belongs to the cluster, and a restarted autoscaler adopts it (:mod:`astralight.autoscale`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Sequence

#: ``prctl`` option number (linux/prctl.h)
PR_SET_PDEATHSIG = 1
#: exit status of a child whose parent died before the parent-death signal was armed
ORPHANED_AT_START = 128 + int(signal.SIGTERM)

try:  # loaded once in the parent: loading a library after fork (in preexec_fn) may deadlock
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - a Linux without a loadable libc
    _LIBC = None
if _LIBC is not None:
    _LIBC.prctl.restype = ctypes.c_int
    _LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                            ctypes.c_ulong]
    _LIBC.signal.restype = ctypes.c_void_p
    _LIBC.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
_SIG_DFL = ctypes.c_void_p(0)

#: whether children can be tied to their parent's life on this platform
PDEATHSIG_SUPPORTED = _LIBC is not None


def child_setup(cpus: Sequence[int] | None = None, die_with_parent: bool = True,
                sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: pin the child to ``cpus`` (if given) and,
    with ``die_with_parent`` on Linux, arm the parent-death signal ``sig`` and exit if the parent
    already died (see the module docstring).

    ``sig`` is also reset to its default action in the child: an *ignored* signal survives exec,
    so a parent started with it ignored (``nohup``, a background job of a non-interactive shell
    ignores SIGINT) would otherwise hand its children a death signal they never act on. The
    child's own handler (installed after exec) still applies.

    The parent's pid is taken here, in the parent: call it right before ``Popen``.
    """
    cpus = list(cpus) if cpus else None
    parent = os.getpid()
    arm = die_with_parent and _LIBC is not None
    sig = int(sig)

    def setup() -> None:  # runs in the child between fork and exec: no locks, no imports
        if cpus:
            os.sched_setaffinity(0, cpus)
        if arm:
            _LIBC.signal(sig, _SIG_DFL)  # libc's, not Python's: this may not be the main thread
            if _LIBC.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
            if os.getppid() != parent:  # the parent died before prctl: no signal will come
                os._exit(ORPHANED_AT_START)

    return setup


def spawn(argv: Sequence[str], *, cpus: Sequence[int] | None = None, die_with_parent: bool = True,
          death_signal: int = signal.SIGTERM, new_session: bool = True, from_thread_ok: bool = False,
          **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``argv`` as a long-lived child that gets ``death_signal`` (default SIGTERM) when
    this process dies.

    ``death_signal``: the signal the child stops on politely (the launcher uses SIGINT for
    trainers: Lightning's graceful stop, which also interrupts a blocking wait; SIGTERM for
    services); ``cpus``: CPU affinity of the child; ``new_session``: a session (and process
    group) of its own, so a terminal's Ctrl-C reaches the parent only and
    ``os.killpg(child.pid, ...)`` reaches the child's own children too; ``popen_kwargs``: passed to :class:`subprocess.Popen` (``stdout``,
    ``env``, ``cwd``, ...; not ``preexec_fn``). Raises RuntimeError when called from a daemon thread
    other than the main thread with ``die_with_parent`` (the thread pitfall, module docstring),
    unless ``from_thread_ok``.
    """
    if "preexec_fn" in popen_kwargs:
        raise TypeError("spawn: preexec_fn is set by spawn itself (use cpus= for the affinity)")
    thread = threading.current_thread()
    if (die_with_parent and PDEATHSIG_SUPPORTED and not from_thread_ok
            and thread is not threading.main_thread() and thread.daemon):
        raise RuntimeError(
            f"spawn: called from daemon thread {thread.name!r}: the child would get SIGTERM when "
            "that thread exits (Linux ties the parent-death signal to the forking thread); spawn "
            "from the main thread or the loop thread that outlives the children, or pass "
            "from_thread_ok=True if this thread does")
    return subprocess.Popen(list(argv), start_new_session=new_session,
                            preexec_fn=child_setup(cpus, die_with_parent, death_signal),
                            **popen_kwargs)


def stop_process(proc: subprocess.Popen | None, timeout_s: float = 20.0) -> int | None:
    """SIGTERM a child and wait ``timeout_s`` for it, then SIGKILL; its exit status (None for
    no process). A child already gone is left as it is."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


__all__ = ["PR_SET_PDEATHSIG", "ORPHANED_AT_START", "PDEATHSIG_SUPPORTED", "child_setup", "spawn",
           "stop_process"]
