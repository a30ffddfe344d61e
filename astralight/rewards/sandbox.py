"""Run untrusted Python programs for RL rewards: a defence-in-depth sandbox.

Code rewards execute whatever a policy wrote, thousands of times per run, so a program that loops,
forks, eats memory, writes over the checkout or talks to the network must fail *its own* test and
leave the host alone. :func:`run_program` runs one program in a separate process tree with layers
that each stop those programs on their own:

1. **Separate interpreter** ``python -I -S -B`` (isolated mode: no ``PYTHON*`` variables, no
   script directory or site-packages on ``sys.path``, no bytecode written) with an **emptied
   environment**, stdin from a file, stdout/stderr through pipes read with a cap.
2. **Resource limits** set in the child before ``exec``: ``RLIMIT_CPU`` (whole seconds, rounded
   up; SIGXCPU then SIGKILL one second later), ``RLIMIT_AS`` (address space → ``MemoryError``),
   ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE = 0``; plus a wall-clock
   deadline enforced by the parent, and a cap on total output after which the program is killed.
3. **Own session / process group**; on exit, timeout or output overflow the parent SIGKILLs the
   whole group, so nothing the program started outlives it.
4. **Namespaces** (when the host permits them; ``isolation_support()`` says): the program runs
   under ``unshare --net --mount --pid --ipc --uts --fork --kill-child --mount-proc``:
   - a new **network namespace** with only a downed loopback: no network at all, not even
     127.0.0.1;
   - a new **PID namespace** whose init is our launcher: when it exits (or is killed) the kernel
     kills every process in the namespace, fork bombs included;
   - a private **mount namespace** in which every mount is made **read-only** (``mount_setattr``
     ``AT_RECURSIVE``; remount loop as fallback) and ``/tmp`` is a fresh size-limited tmpfs; the
     working directory is ``/tmp/work`` inside it, and it vanishes with the namespace. A
     non-world-traversable ancestor of the interpreter's prefix (e.g. ``/root`` for pyenv) is
     covered by an empty tmpfs and the prefix bound back read-only, so the sandbox user can run
     Python without seeing the rest of that directory.
5. **Unprivileged user**: when the parent is root the program runs as ``uid`` (``nobody`` by
   default) with no supplementary groups and ``PR_SET_NO_NEW_PRIVS``; only then is
   ``RLIMIT_NPROC`` enforced (the kernel ignores it for root) and file permissions apply.
   Without a mount namespace this needs a world-reachable interpreter; otherwise (e.g. pyenv
   under ``/root``) the program stays root, and ``guard=False`` is refused because nothing would
   bound its process count. A non-root parent runs the program as itself (RLIMIT_NPROC then
   counts all of that user's processes, so ``max_processes=0`` still blocks every fork).
   ``RLIMIT_NPROC`` counts *all* processes of that uid on the host: concurrent sandboxes sharing a
   uid share the count (harmless with the default ``max_processes=0``; pass distinct ``uid``
   values for exact per-run counts with ``max_processes > 0``).
6. **In-process guard** (``guard=True``): a ``sys.addaudithook`` hook (which Python code cannot
   remove) installed before the program runs refuses fork/exec/spawn/``os.system``/subprocess,
   every socket operation, signals to other processes, ``setrlimit``, crafting code objects,
   importing ``ctypes``/``_posixsubprocess``, and any file write, rename, removal, chmod... whose
   resolved path is outside the working directory (``/dev/null`` excepted).

What this is **not**: a security boundary like gVisor, Firecracker or a seccomp-filtered container.
The guard is a tripwire a determined program can evade (e.g. ``dir_fd``-relative opens, or an
interpreter memory-corruption bug); the OS layers share the host kernel (a kernel exploit escapes
them) and there is no seccomp filter, no cgroup memory/pids limit (``RLIMIT_AS`` is per process,
``RLIMIT_NPROC`` per uid), and files stay *readable* wherever the sandbox uid's permissions allow.
Without namespaces (``isolation="basic"``, or hosts that refuse ``unshare``) there is no network or
filesystem isolation beyond the guard and the uid's permissions: run such hosts' rewards inside a
real container. Every result lists the layers that were actually applied in ``isolation``.

:func:`run_call` runs a program the same way (same process, layers and limits; empty stdin) but,
instead of executing it as a script, a harness imports it, calls one named function with JSON
arguments and reports the return value as JSON on a pipe of its own; its docstring gives the
threat model (the expected value never enters the sandbox; the caller compares).
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

__all__ = ["SandboxResult", "SandboxError", "run_program", "run_call", "CALL_PRELUDE",
           "isolation_support"]

MEMORY_EXIT = 117  # the runner's exit code for an uncaught MemoryError (RLIMIT_AS hit)
NS_FLAGS = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
            "--mount-proc"]


class SandboxError(RuntimeError):
    """The sandbox itself could not run a program (never raised for what the program does)."""


@dataclass
class SandboxResult:
    """How one program run ended.

    ``status``: ``ok`` (exit 0), ``error`` (non-zero exit, e.g. an exception), ``timeout`` (CPU or
    wall limit), ``memory`` (``MemoryError`` under the address-space limit), ``output_limit``
    (killed for writing more than ``max_output_bytes``), ``killed`` (another signal).
    ``returncode``: the exit code, ``-signal`` when a signal ended it, None when the sandbox killed
    it at the wall deadline or for output. ``cpu_s``: user + system CPU of the program and the
    children it waited for (None when it was killed before reporting). ``stdout``/``stderr`` keep
    the first ``output_cap`` bytes (decoded as UTF-8 with replacement); ``*_truncated`` says when
    more was written. ``pgid`` is the process group the run lived in (all of it is killed at the
    end). ``isolation`` names the layers applied. :func:`run_call` only: ``returned`` is the JSON
    text of the value the called function returned (None when the harness did not report one
    validly; ``harness_error`` says why).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    cpu_s: float | None
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    signal: int | None = None
    pgid: int = 0
    isolation: tuple[str, ...] = field(default_factory=tuple)
    returned: str | None = None
    harness_error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --------------------------------------------------------------------------------------------
# Code that runs in the sandbox processes. Kept as source strings so that the child needs no
# import of this package (its sys.path has no site-packages) and starts from a clean interpreter.

_LAUNCHER = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
status_fd = cfg["status_fd"]

def report(d):
    try:
        os.write(status_fd, json.dumps(d).encode())
    except OSError:
        pass

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
libc = ctypes.CDLL(None, use_errno=True)

def mount(src, tgt, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(tgt), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s on %s: %s" % (src or fstype, tgt, os.strerror(e)))

class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

def mount_setattr(path, recursive, set_=0, clr=0):
    attr = MountAttr(set_, clr, 0, 0)
    nr = {"x86_64": 442, "aarch64": 442}.get(os.uname().machine, 442)
    r = libc.syscall(ctypes.c_long(nr), ctypes.c_int(-100), path.encode(),
                     ctypes.c_uint(0x8000 if recursive else 0), ctypes.byref(attr),
                     ctypes.c_size_t(ctypes.sizeof(attr)))
    if r != 0:
        raise OSError(ctypes.get_errno(), "mount_setattr " + path)

def make_readonly_except_tmp():
    try:
        mount_setattr("/", True, set_=1)
        mount_setattr("/tmp", False, clr=1)
        return
    except OSError:
        pass
    bits = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    failed = []
    with open("/proc/self/mountinfo") as f:
        entries = [line.split() for line in f]
    for e in entries:
        point, opts = e[4].encode().decode("unicode_escape"), e[5].split(",")
        if point == "/tmp":
            continue
        extra = sum(bits.get(o, 0) for o in opts)
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)
        except OSError:
            failed.append(point)
    if failed:
        raise OSError(0, "could not make read-only: %s" % failed[:5])

def setup_namespace():
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=755" % cfg["disk_mb"])
    hidden, prefix = cfg["hidden_ancestor"], cfg["prefix"]
    if hidden:
        stage = "/tmp/.interpreter"
        os.mkdir(stage)
        mount(prefix, stage, None, MS_BIND | MS_REC)
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        os.makedirs(prefix, mode=0o755, exist_ok=True)
        mount(stage, prefix, None, MS_MOVE)
        os.rmdir(stage)
    make_readonly_except_tmp()
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    return work

try:
    code_fd = os.open(cfg["code_path"], os.O_RDONLY)
    work = setup_namespace() if cfg["namespaces"] else cfg["workdir"]
    uid = cfg["uid"]
    if uid is not None:
        os.chown(work, uid, uid)
    os.chdir(work)
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means exec succeeded
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_fd)
            os.close(err_r)
            os.set_inheritable(code_fd, True)
            if cfg["result_fd"] >= 0:
                os.set_inheritable(cfg["result_fd"], True)
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            mb = 1024 * 1024
            cpu = cfg["cpu_limit"]
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2)
            resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_mb"] * mb,) * 2)
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
            py = cfg["python"]
            os.execve(py, [py, "-I", "-S", "-B", "-c", cfg["runner"], str(code_fd),
                           "1" if cfg["guard"] else "0", str(cfg["memory_exit"]),
                           str(cfg["result_fd"])], {})
        except BaseException as e:
            try:
                os.write(err_w, ("%s: %s" % (type(e).__name__, e)).encode())
            finally:
                os._exit(127)
    os.close(err_w)
    os.close(code_fd)
    if cfg["result_fd"] >= 0:
        os.close(cfg["result_fd"])  # only the runner may hold the result pipe open
    err = b""
    while True:
        chunk = os.read(err_r, 4096)
        if not chunk:
            break
        err += chunk
    while True:
        wpid, st, ru = os.wait4(-1 if cfg["namespaces"] else pid, 0)
        if wpid == pid:
            break
    if err:
        report({"setup_error": "starting the program: " + err.decode(errors="replace")})
    else:
        out = {"cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_kb": ru.ru_maxrss}
        if os.WIFSIGNALED(st):
            out["signal"] = os.WTERMSIG(st)
        else:
            out["exit"] = os.WEXITSTATUS(st)
        report(out)
except BaseException as e:
    report({"setup_error": "%s: %s" % (type(e).__name__, e)})
'''

_RUNNER = r'''
import sys, posix as os_
def _guard(root):
    import posixpath
    O_W = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000  # O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND
    blocked = frozenset([
        "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
        "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
        "resource.setrlimit", "resource.prlimit", "code.__new__", "os.startfile"])
    blocked_prefixes = ("socket.", "ctypes.", "_winapi.")
    blocked_modules = frozenset(["ctypes", "_ctypes", "_posixsubprocess", "cffi", "_testcapi",
                                 "_testinternalcapi", "_xxsubinterpreters", "_xxinterpchannels"])
    first_path = frozenset(["os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                            "os.truncate", "os.utime", "os.mkfifo", "os.mknod",
                            "os.setxattr", "os.removexattr", "shutil.rmtree", "shutil.chown"])
    both_paths = frozenset(["os.rename", "os.link", "shutil.copyfile", "shutil.copymode",
                            "shutil.copystat", "shutil.copytree", "shutil.move"])
    writable_files = frozenset(["/dev/null"])

    def inside(p):
        if isinstance(p, int):
            return True  # an already-open descriptor
        try:
            p = os_.fsdecode(p) if hasattr(os_, "fsdecode") else (
                p.decode() if isinstance(p, bytes) else str(p))
            full = posixpath.realpath(posixpath.join(os_.getcwd(), p))
        except Exception:
            return False
        return full == root or full.startswith(root + "/") or full in writable_files

    def deny(event, detail=""):
        raise PermissionError("sandbox: %s is not allowed%s" % (event, detail))

    def hook(event, args):
        if event in blocked or event.startswith(blocked_prefixes):
            deny(event)
        if event == "import":
            if str(args[0]).partition(".")[0] in blocked_modules:
                deny("importing " + str(args[0]))
        elif event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & O_W)
            if writing and not inside(path):
                deny("writing " + repr(path), " (outside the working directory)")
        elif event in first_path:
            if not inside(args[0]):
                deny(event + " " + repr(args[0]), " (outside the working directory)")
        elif event in both_paths or event == "os.symlink":
            paths = args[1:2] if event == "os.symlink" else args[0:2]
            for p in paths:
                if not inside(p):
                    deny(event + " " + repr(p), " (outside the working directory)")

    sys.addaudithook(hook)

def _out_of_memory(g, memory_exit):
    g.clear()
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os_.write(2, b"MemoryError: the program exceeded its memory limit\n")
    os_._exit(memory_exit)

def _call(raw, result_fd, guard, memory_exit):
    # Function-call harness (see run_call): everything it needs is read and bound before the
    # candidate's code runs; the expected value is never here, only the arguments.
    import json
    spec = json.loads(raw)
    dumps, write = json.dumps, os_.write
    nonce, fn_name = spec["nonce"], spec["fn_name"]
    args = json.loads(spec["args"])
    prelude = compile(spec["prelude"], "<prelude>", "exec")
    code = compile(spec["code"], "solution.py", "exec")
    del spec, raw
    sys.argv = ["solution.py"]
    if guard:
        import posixpath
        _guard(posixpath.realpath(os_.getcwd()))
    # not "__main__": an `if __name__ == "__main__":` block (a stdin driver) must not run
    g = {"__name__": "solution", "__builtins__": __builtins__, "__file__": "solution.py"}
    try:
        exec(prelude, g)
        exec(code, g)
        cls = g.get("Solution")
        if isinstance(cls, type) and hasattr(cls, fn_name):
            target = getattr(cls(), fn_name)  # LeetCode style
        elif callable(g.get(fn_name)):
            target = g[fn_name]
        else:
            raise NameError("the program defines neither Solution.%s nor a function %s"
                            % (fn_name, fn_name))
        value = target(*args)
        line = dumps({"nonce": nonce, "value": value}) + "\n"
    except MemoryError:
        _out_of_memory(g, memory_exit)
    data = line.encode("ascii")
    while data:
        data = data[write(result_fd, data):]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os_._exit(0)  # no atexit hooks or lingering threads of the program run after the record

def _main():
    code_fd, guard, memory_exit = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
    result_fd = int(sys.argv[4])
    chunks = []
    while True:
        b = os_.read(code_fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os_.close(code_fd)
    raw = b"".join(chunks)
    del chunks
    if result_fd >= 0:
        return _call(raw, result_fd, guard, memory_exit)
    code = compile(raw, "solution.py", "exec")
    sys.argv = ["solution.py"]
    if guard:
        import posixpath
        _guard(posixpath.realpath(os_.getcwd()))
    g = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "solution.py"}
    try:
        exec(code, g)
    except MemoryError:
        _out_of_memory(g, memory_exit)

_main()
'''


# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def isolation_support() -> dict:
    """What this host lets the sandbox use: ``{"namespaces": bool, "root": bool, "reason": str}``.

    Probed once per process by running ``unshare`` with the sandbox's flags.
    """
    root = os.geteuid() == 0
    exe = shutil.which("unshare")
    if exe is None:
        return {"namespaces": False, "root": root, "reason": "no unshare command on PATH"}
    try:
        proc = subprocess.run([exe, *NS_FLAGS, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"namespaces": False, "root": root, "reason": f"unshare failed: {e}"}
    if proc.returncode != 0:
        return {"namespaces": False, "root": root,
                "reason": "unshare refused: " + proc.stderr.decode(errors="replace").strip()}
    return {"namespaces": True, "root": root, "reason": "", "unshare": exe}


def _interpreter() -> tuple[str, str]:
    """(real path of the Python binary, the installation prefix that holds it)."""
    exe = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not exe.startswith(prefix + os.sep):
        prefix = os.path.dirname(os.path.dirname(exe))
    return exe, prefix


def _hidden_ancestor(path: str) -> str | None:
    """Topmost ancestor of ``path`` (or itself) that others cannot traverse, else None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        p = "/" + "/".join(parts[:i])
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return p
        except OSError:
            return p
    return None


def _decide_isolation(isolation: str) -> bool:
    if isolation not in ("auto", "namespaces", "basic"):
        raise ValueError(f"isolation: expected 'auto', 'namespaces' or 'basic', got {isolation!r}")
    if isolation == "basic":
        return False
    support = isolation_support()
    if support["namespaces"]:
        return True
    if isolation == "namespaces":
        raise SandboxError(f"isolation='namespaces' but this host refuses them: "
                           f"{support['reason']}; use isolation='auto' or 'basic'")
    return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(code: str, stdin: str = "", *, cpu_s: float = 2.0, wall_s: float = 5.0,
                memory_mb: int = 256, file_size_mb: int = 1, max_processes: int = 0,
                output_cap: int = 64 * 1024, max_output_bytes: int = 8 * 1024 * 1024,
                disk_mb: int = 16, isolation: str = "auto", guard: bool = True,
                uid: int | None = 65534) -> SandboxResult:
    """Run ``code`` (Python source) with ``stdin``; see the module docstring for the layers.

    Args:
        cpu_s: CPU-time limit, rounded up to whole seconds (RLIMIT_CPU's unit).
        wall_s: wall-clock limit enforced by the parent (catches sleeping/blocked programs).
        memory_mb: address-space limit of each process (Python itself needs ~20 MB).
        file_size_mb: largest file the program may write.
        max_processes: extra processes the program may fork (0 = none); enforced by
            RLIMIT_NPROC only when running as a non-root uid, and by the guard.
        output_cap: bytes of stdout and of stderr kept in the result.
        max_output_bytes: total output after which the program is killed (``output_limit``).
        disk_mb: size of the private ``/tmp`` tmpfs (namespaces only).
        isolation: ``auto`` (namespaces when the host allows them), ``namespaces`` (require them),
            ``basic`` (no namespaces).
        guard: install the in-process audit-hook guard.
        uid: user to run as when the parent is root (None: stay root — then RLIMIT_NPROC is not
            enforced). Ignored when not root.
    """
    result, _, _ = _execute(code, stdin, None, cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb,
                            file_size_mb=file_size_mb, max_processes=max_processes,
                            output_cap=output_cap, max_output_bytes=max_output_bytes,
                            disk_mb=disk_mb, isolation=isolation, guard=guard, uid=uid)
    return result


#: Trusted source run in the program's namespace before it, in :func:`run_call` only: the
#: standard-library names LeetCode-style solutions use without importing them (``List``,
#: ``Optional``, ``defaultdict``, ``heappush``, ...), as LiveCodeBench's and TACO's call-based
#: judges prepend; no star import, so no builtin (``pow``, ``open``) is shadowed. The recursion
#: limit matches LiveCodeBench's judge (deep DFS solutions are common).
CALL_PRELUDE = """\
import sys, math, re, string, copy, heapq, bisect, itertools, functools, operator, collections
import random, datetime
from typing import (Any, Callable, DefaultDict, Deque, Dict, FrozenSet, Generator, Iterable,
                    Iterator, List, Optional, Set, Tuple, Union)
from collections import Counter, OrderedDict, defaultdict, deque, namedtuple
from itertools import (accumulate, chain, combinations, combinations_with_replacement, count,
                       cycle, groupby, islice, pairwise, permutations, product, repeat,
                       zip_longest)
from functools import cache, cmp_to_key, lru_cache, partial, reduce
from heapq import (heapify, heappop, heappush, heappushpop, heapreplace, merge, nlargest,
                   nsmallest)
from bisect import bisect, bisect_left, bisect_right, insort, insort_left, insort_right
from math import (ceil, comb, factorial, floor, gcd, inf, isqrt, lcm, log, log2, log10, perm,
                  pi, prod, sqrt)
from string import ascii_letters, ascii_lowercase, ascii_uppercase, digits
from copy import deepcopy
from operator import attrgetter, itemgetter
sys.setrecursionlimit(50000)
"""


def run_call(code: str, fn_name: str, args_json: str, *, cpu_s: float = 2.0,
             wall_s: float = 5.0, memory_mb: int = 256, file_size_mb: int = 1,
             max_processes: int = 0, output_cap: int = 64 * 1024,
             max_output_bytes: int = 8 * 1024 * 1024, disk_mb: int = 16,
             isolation: str = "auto", guard: bool = True, uid: int | None = 65534,
             result_cap: int = 64 * 1024, prelude: str = CALL_PRELUDE) -> SandboxResult:
    """Import ``code`` and call ``Solution().<fn_name>`` (when the program defines a class
    ``Solution`` with that attribute, LeetCode style) or else its top-level function
    ``<fn_name>`` with the arguments ``args_json`` (JSON text of a list); report what it returned.

    The run has exactly the layers and limits of :func:`run_program` (same keywords, one process
    per call; stdin is empty). After :data:`CALL_PRELUDE` and the program's module body
    (``__name__`` is ``"solution"``, so an ``if __name__ == "__main__":`` driver does not run) the
    harness calls the function, writes ``{"nonce", "value"}`` as one JSON line to a pipe of its
    own and ends the process with ``os._exit(0)``. The parent reads that pipe (``result_cap``
    bytes at most) and sets ``result.returned`` to the JSON text of the value, or leaves it None
    and says why in ``result.harness_error``. A crash, timeout, memory or output overrun, an early
    ``sys.exit``/``os._exit``, a value JSON cannot encode (a set, an object) or anything but
    exactly one well-formed record with the right nonce on the pipe leaves ``returned`` None.

    Threat model. The candidate program runs in the same interpreter as the harness, after it,
    so it can do anything the harness can: read the nonce (e.g. from the harness's frame),
    write to the result pipe, patch ``json``, print anything, exit at any point. The design
    therefore trusts the child for nothing but *the value it chooses to report*:

    - the **expected value never enters the sandbox** (only the arguments do) and the parent
      compares (:func:`astralight.rewards.code.returns_match`), so there is no "PASS" for the
      child to print or forge: every way of tampering with the channel amounts to choosing the
      reported value, which a program can do honestly by returning it;
    - stdout/stderr are never parsed, so printing the expected output does nothing;
    - exiting before the harness writes (``sys.exit(0)`` at import time or in the function,
      ``os._exit``) leaves no record: the case fails even though the exit status is 0;
    - a record written by the program *and* the harness's record make two records: the case
      fails; garbage or a wrong nonce fails; a flood of bytes is cut at ``result_cap`` (fails)
      and counts towards ``max_output_bytes`` (killed);
    - the nonce (fresh per call, ``secrets``) is not a secret from a determined program; it binds
      a record to this run and keeps stray writes (a program that happens to write JSON to an
      inherited descriptor) from ever passing;
    - the parent parses the record with ``json`` only (no pickle, no ``eval``); a value too deep
      to parse is a failure, not a parent crash.

    Out of scope, as for stdin programs: a program that learns expected outputs outside the
    sandbox channel (e.g. from examples in the problem statement, or by reading the parent's
    memory when the host allows neither namespaces nor a separate uid; see the module
    docstring's limits).
    """
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise ValueError(f"fn_name: expected a Python identifier, got {fn_name!r}")
    try:
        args = json.loads(args_json)
    except (TypeError, ValueError) as e:
        raise ValueError(f"args_json: not JSON text of a list of arguments ({e})") from None
    if not isinstance(args, list):
        raise ValueError(f"args_json: expected JSON text of a list of arguments, "
                         f"got a {type(args).__name__}")
    if result_cap < 64:
        raise ValueError(f"result_cap: must be >= 64 bytes, got {result_cap}")
    nonce = secrets.token_hex(16)
    payload = json.dumps({"code": code, "fn_name": fn_name, "args": args_json, "nonce": nonce,
                          "prelude": prelude})
    result, data, truncated = _execute(
        payload, "", result_cap, cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb,
        file_size_mb=file_size_mb, max_processes=max_processes, output_cap=output_cap,
        max_output_bytes=max_output_bytes, disk_mb=disk_mb, isolation=isolation, guard=guard,
        uid=uid)
    if result.status != "ok":
        result.harness_error = f"the run ended with status {result.status!r}"
    else:
        result.returned, result.harness_error = _read_record(data, truncated, nonce)
    return result


def _read_record(data: bytes, truncated: bool, nonce: str) -> tuple[str | None, str]:
    """(JSON text of the reported value, "") or (None, why there is no valid record)."""
    if truncated:
        return None, "the result record exceeded result_cap"
    if not data:
        return None, "no result record (the program exited before the harness reported)"
    lines = data.split(b"\n")
    if len(lines) != 2 or lines[1]:
        return None, "not exactly one result record on the result pipe"
    try:
        record = json.loads(lines[0].decode("ascii"))
        if not isinstance(record, dict) or set(record) != {"nonce", "value"}:
            return None, "malformed result record"
        if not isinstance(record["nonce"], str) or not hmac.compare_digest(
                record["nonce"], nonce):
            return None, "result record with a wrong nonce"
        return json.dumps(record["value"]), ""
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"unreadable result record ({type(e).__name__})"


def _execute(payload: str, stdin: str, result_cap: int | None, *, cpu_s: float, wall_s: float,
             memory_mb: int, file_size_mb: int, max_processes: int, output_cap: int,
             max_output_bytes: int, disk_mb: int, isolation: str, guard: bool,
             uid: int | None) -> tuple[SandboxResult, bytes, bool]:
    """One sandboxed run of the runner. ``payload`` is the program (stdin mode, ``result_cap``
    None) or the JSON call spec of :func:`run_call` (with a result pipe kept to ``result_cap``
    bytes). Returns (result, result-pipe bytes, whether they were cut)."""
    if wall_s <= 0 or cpu_s <= 0:
        raise ValueError(f"cpu_s/wall_s: must be > 0, got cpu_s={cpu_s} wall_s={wall_s}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb: the interpreter alone needs ~20 MB, got {memory_mb}")
    use_ns = _decide_isolation(isolation)
    root = os.geteuid() == 0
    exe, prefix = _interpreter()
    hidden = _hidden_ancestor(prefix)
    # Without a mount namespace an unreachable interpreter cannot be bound back: stay root then.
    run_uid = uid if (root and uid is not None and (use_ns or hidden is None)) else None
    if use_ns and hidden is not None and (hidden == "/tmp" or hidden.startswith("/tmp/")):
        raise SandboxError(f"interpreter prefix {prefix} lies under /tmp, which the sandbox "
                           f"replaces; install Python elsewhere or use isolation='basic'")
    if not guard and run_uid is None:
        raise SandboxError("guard=False needs a process-count limit, and RLIMIT_NPROC is not "
                           "enforced for root: run as a non-root uid (uid=..., with a mount "
                           "namespace when the interpreter is not world-reachable) or keep "
                           "guard=True")
    layers = ["process", "rlimits", "pgroup"]
    if use_ns:
        layers += ["netns", "pidns", "mountns-ro", "private-tmp"]
    if run_uid is not None:
        layers += [f"uid={run_uid}", "nproc"]
    if guard:
        layers.append("guard")

    base = tempfile.mkdtemp(prefix="astralight-sbx-")
    status_r = status_w = result_r = result_w = -1
    proc = None
    try:
        code_path = os.path.join(base, "code.py")
        stdin_path = os.path.join(base, "stdin")
        workdir = os.path.join(base, "work")
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(payload)
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        os.mkdir(workdir, 0o700)
        if run_uid is not None:
            os.chmod(base, 0o711)  # the uid must reach its working directory (basic mode)
        status_r, status_w = os.pipe()
        pass_fds = [status_w]
        if result_cap is not None:
            result_r, result_w = os.pipe()
            pass_fds.append(result_w)
        cfg = {
            "status_fd": status_w, "code_path": code_path, "workdir": workdir,
            "namespaces": use_ns, "disk_mb": int(disk_mb), "hidden_ancestor": hidden,
            "prefix": prefix, "python": exe, "uid": run_uid, "guard": bool(guard),
            "cpu_limit": max(1, math.ceil(cpu_s)), "memory_mb": int(memory_mb),
            "file_size_mb": int(file_size_mb), "nproc": 1 + int(max_processes),
            "memory_exit": MEMORY_EXIT, "runner": _RUNNER, "result_fd": result_w,
        }
        cmd = [exe, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(cfg)]
        if use_ns:
            cmd = [isolation_support()["unshare"], *NS_FLAGS, *cmd]
        start = time.monotonic()
        with open(stdin_path, "rb") as fin:
            proc = subprocess.Popen(cmd, stdin=fin, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=tuple(pass_fds), env={},
                                    cwd=base, start_new_session=True)
        os.close(status_w)
        status_w = -1
        if result_w >= 0:
            os.close(result_w)
            result_w = -1
        pgid = proc.pid
        streams = {"out": (proc.stdout.fileno(), output_cap),
                   "err": (proc.stderr.fileno(), output_cap)}
        if result_r >= 0:
            streams["res"] = (result_r, int(result_cap))
        bufs, timed_out, overflow = _pump(proc, start + wall_s, streams, max_output_bytes)
        out, err = bufs["out"], bufs["err"]
        _terminate(proc, pgid)
        wall = time.monotonic() - start
        report = _read_status(status_r)
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
            proc.wait()
        if proc is not None:
            _wait_group_gone(proc.pid)
        for fd in (status_r, status_w, result_r, result_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(base, ignore_errors=True)

    if report.get("setup_error") and not (timed_out or overflow):
        raise SandboxError(f"sandbox setup failed: {report['setup_error']}")
    cpu = report.get("cpu_s")
    sig = report.get("signal")
    if overflow:
        status, rc = "output_limit", None
    elif timed_out:
        status, rc = "timeout", None
    elif "exit" not in report and sig is None:  # the launcher vanished without a word
        status, rc = "killed", None
    elif sig is not None:
        rc = -sig
        # SIGKILL we did not send comes from RLIMIT_CPU's hard limit (or the OOM killer); rusage
        # is tick-sampled, so compare loosely.
        hit_cpu = cpu is not None and cpu >= 0.8 * max(1, math.ceil(cpu_s))
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and hit_cpu):
            status = "timeout"
        else:
            status = "killed"
    else:
        rc = report["exit"]
        status = "ok" if rc == 0 else ("memory" if rc == MEMORY_EXIT else "error")
    res = bufs.get("res", (b"", False))
    return SandboxResult(
        status=status, returncode=rc,
        stdout=bytes(out[0]).decode("utf-8", errors="replace"),
        stderr=bytes(err[0]).decode("utf-8", errors="replace"),
        cpu_s=cpu, wall_s=wall, stdout_truncated=out[1], stderr_truncated=err[1], signal=sig,
        pgid=pgid, isolation=tuple(layers)), bytes(res[0]), res[1]


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, from /proc."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(name))
    return members


def _terminate(proc: subprocess.Popen, pgid: int) -> None:
    """End the run and reap its top process without leaving zombies behind.

    Everything in the group except the top process (``unshare`` or the launcher) is killed
    first, so the top reaps its own child: with a PID namespace, killing its init makes the kernel
    kill and reap the whole namespace. The top then exits by itself; if it does not, the whole
    group is killed.
    """
    for _ in range(200):
        if proc.poll() is not None:
            break
        members = [p for p in _group_members(pgid) if p != proc.pid]
        if not members:
            break
        for p in members:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=0.02)
        except subprocess.TimeoutExpired:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_group(pgid)
        proc.wait()
    _kill_group(pgid)  # leftovers whose parent already exited (basic mode)


def _wait_group_gone(pgid: int, timeout: float = 5.0) -> None:
    """Wait (bounded) until no live process of the run's group remains; warn if one does."""
    deadline = time.monotonic() + timeout
    while True:
        left = _group_members(pgid)
        if not left:
            return
        if time.monotonic() > deadline:
            log.warning("sandbox: processes %s of group %d still alive after the run", left, pgid)
            return
        _kill_group(pgid)
        time.sleep(0.01)


def _pump(proc: subprocess.Popen, deadline: float, streams: dict[str, tuple[int, int]],
          max_total: int):
    """Read the streams ``{name: (fd, cap)}`` until the program is done, the deadline passes or
    the output (all streams together) overflows ``max_total``.

    Keeps ``cap`` bytes per stream; once the top process has exited its group is killed so that
    leftover children cannot hold the pipes open. Returns ``({name: (bytes, truncated)},
    timed_out, overflow)``.
    """
    bufs = {name: bytearray() for name in streams}
    truncated = {name: False for name in streams}
    caps = {name: cap for name, (_, cap) in streams.items()}
    total = 0
    sel = selectors.DefaultSelector()
    for name, (fd, _) in streams.items():
        sel.register(fd, selectors.EVENT_READ, name)
    pidfd = -1
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    except (AttributeError, OSError):
        pass
    open_streams, exited, timed_out, overflow = len(streams), False, False, False
    try:
        while open_streams or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            wait = remaining if pidfd >= 0 else min(remaining, 0.05)
            for key, _ in sel.select(wait):
                if key.data == "exit":
                    sel.unregister(key.fileobj)
                    exited = True
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                total += len(chunk)
                buf = bufs[key.data]
                room = caps[key.data] - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > max(room, 0):
                    truncated[key.data] = True
                if total > max_total:
                    overflow = True
            if overflow:
                break
            if not exited and pidfd < 0 and proc.poll() is not None:
                exited = True
            if exited:
                _kill_group(proc.pid)
    finally:
        sel.close()
        if pidfd >= 0:
            os.close(pidfd)
    return {name: (bufs[name], truncated[name]) for name in streams}, timed_out, overflow


def _read_status(fd: int) -> dict:
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    if not data:
        return {}
    try:
        return json.loads(data)
    except ValueError:
        return {"setup_error": f"unreadable launcher status {data[:200]!r}"}
