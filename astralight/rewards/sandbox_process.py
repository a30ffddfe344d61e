"""One sandboxed run from the parent's side: start the launcher in its own session, pump its
output under the caps and the wall deadline, kill and reap its whole process group, and turn the
launcher's status report into a :class:`~astralight.rewards.sandbox_result.SandboxResult`.

:func:`execute` is the single runner behind :func:`~astralight.rewards.sandbox.run_program` and
:func:`~astralight.rewards.sandbox.run_call`; the code it starts is
:mod:`astralight.rewards.sandbox_child`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time

from astralight.rewards.sandbox_child import LAUNCHER, MEMORY_EXIT, RUNNER
from astralight.rewards.sandbox_host import (NS_FLAGS, decide_isolation, hidden_ancestor,
                                             interpreter, isolation_support)
from astralight.rewards.sandbox_result import SandboxError, SandboxResult

log = logging.getLogger("astralight.rewards.sandbox")

__all__ = ["execute"]


def execute(payload: str, stdin: str, result_cap: int | None, *, cpu_s: float, wall_s: float,
            memory_mb: int, file_size_mb: int, max_processes: int, output_cap: int,
            max_output_bytes: int, disk_mb: int, isolation: str, guard: bool,
            uid: int | None) -> tuple[SandboxResult, bytes, bool]:
    """One sandboxed run of the runner. ``payload`` is the program (stdin mode, ``result_cap``
    None) or the JSON call spec of :func:`~astralight.rewards.sandbox.run_call` (with a result pipe kept to ``result_cap``
    bytes). Returns (result, result-pipe bytes, whether they were cut)."""
    if wall_s <= 0 or cpu_s <= 0:
        raise ValueError(f"cpu_s/wall_s: must be > 0, got cpu_s={cpu_s} wall_s={wall_s}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb: the interpreter alone needs ~20 MB, got {memory_mb}")
    use_ns = decide_isolation(isolation)
    root = os.geteuid() == 0
    exe, prefix = interpreter()
    hidden = hidden_ancestor(prefix)
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
            "memory_exit": MEMORY_EXIT, "runner": RUNNER, "result_fd": result_w,
        }
        cmd = [exe, "-I", "-S", "-B", "-c", LAUNCHER, json.dumps(cfg)]
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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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
