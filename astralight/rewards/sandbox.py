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

This module holds those two entry points; the run itself is
:func:`astralight.rewards.sandbox_process.execute`, the code started in the child processes is
:mod:`astralight.rewards.sandbox_child`, the host probe is :mod:`astralight.rewards.sandbox_host`
and the result type :mod:`astralight.rewards.sandbox_result`.
"""

from __future__ import annotations

import hmac
import json
import secrets

from astralight.rewards.sandbox_host import isolation_support
from astralight.rewards.sandbox_process import execute
from astralight.rewards.sandbox_result import SandboxError, SandboxResult

__all__ = ["SandboxResult", "SandboxError", "run_program", "run_call", "CALL_PRELUDE",
           "isolation_support"]


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
    result, _, _ = execute(code, stdin, None, cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb,
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
    result, data, truncated = execute(
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
