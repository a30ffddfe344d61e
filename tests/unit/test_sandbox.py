"""The code sandbox against hostile programs: each test asserts the sandbox held and the host did
not notice.

Two configurations are exercised where it matters:
- ``default``: what rewards use (namespaces when the host allows them, the audit-hook guard);
- ``os_only``: namespaces + unprivileged uid with the guard OFF, proving the OS layers hold on
  their own (skipped on hosts that refuse namespaces or when not root).
Limits are small (1 s CPU) so the file stays fast on a busy 2-core machine.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import uuid
from pathlib import Path

import pytest

from astralight.rewards.code import extract_code, outputs_match, run_tests
from astralight.rewards.sandbox import (SandboxError, isolation_support, run_program)

SUPPORT = isolation_support()
OS_LAYERS = SUPPORT["namespaces"] and SUPPORT["root"]

CONFIGS = {
    "default": {},
    "os_only": {"isolation": "namespaces", "guard": False},
}


def config(name):
    if name == "os_only" and not OS_LAYERS:
        pytest.skip(f"host refuses namespaces or not root: {SUPPORT['reason']}")
    return dict(CONFIGS[name])


def live_group_members(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != b"Z":
                out.append(int(name))
    return out


def processes_of_uid(uid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                status = Path(f"/proc/{name}/status").read_text()
            except OSError:
                continue
            if f"\nUid:\t{uid}\t" in status:
                out.append(int(name))
    return out


def assert_host_fine():
    """The host still runs a normal sandboxed program, and can still fork itself."""
    r = run_program("print(sum(range(10)))")
    assert r.status == "ok" and r.stdout == "45\n"
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7


# ------------------------------------------------------------------------------ normal programs


@pytest.mark.parametrize("name", ["default", "os_only"])
def test_normal_program_reads_stdin_writes_stdout(name):
    code = "import sys\ndata = sys.stdin.read().split()\nprint(sum(map(int, data)))\n"
    before = set(glob.glob("/tmp/astralight-sbx-*"))
    r = run_program(code, "1 2\n3\n", **config(name))
    assert (r.status, r.returncode, r.stdout, r.stderr) == ("ok", 0, "6\n", "")
    assert r.cpu_s is not None and r.cpu_s >= 0
    assert ("guard" in r.isolation) == (name == "default")
    if OS_LAYERS:
        assert {"netns", "pidns", "mountns-ro", "uid=65534", "nproc"} <= set(r.isolation)
    # its temporary directory is gone
    assert set(glob.glob("/tmp/astralight-sbx-*")) <= before


def test_program_may_write_its_own_working_directory_only():
    r = run_program("open('scratch.txt', 'w').write('hi')\nprint(open('scratch.txt').read())")
    assert r.status == "ok" and r.stdout == "hi\n"


def test_environment_is_emptied():
    os.environ["ASTRALIGHT_SANDBOX_SECRET"] = "leak"
    try:
        r = run_program("import os\nprint(sorted(os.environ))")
    finally:
        del os.environ["ASTRALIGHT_SANDBOX_SECRET"]
    assert r.status == "ok" and "ASTRALIGHT_SANDBOX_SECRET" not in r.stdout


def test_errors_are_reported_not_raised():
    r = run_program("raise ValueError('boom')")
    assert r.status == "error" and r.returncode == 1 and "ValueError: boom" in r.stderr
    r = run_program("def f(:\n")
    assert r.status == "error" and "SyntaxError" in r.stderr
    r = run_program("import sys\nsys.exit(3)")
    assert r.status == "error" and r.returncode == 3


# ------------------------------------------------------------------------------ hostile programs


@pytest.mark.parametrize("name", ["default", "os_only"])
def test_infinite_loop_hits_the_cpu_limit(name):
    r = run_program("while True:\n    pass\n", cpu_s=1, wall_s=20, **config(name))
    assert r.status == "timeout"
    # RLIMIT_CPU ended it (SIGXCPU, or SIGKILL at the hard limit), long before the wall limit
    assert r.signal in (signal.SIGXCPU, signal.SIGKILL)
    assert r.wall_s < 20
    assert live_group_members(r.pgid) == []


def test_sleeping_program_hits_the_wall_limit():
    r = run_program("import time\ntime.sleep(1000)\n", cpu_s=5, wall_s=1)
    assert r.status == "timeout" and r.returncode is None
    assert 1 <= r.wall_s < 1000
    assert live_group_members(r.pgid) == []


FORK_BOMB = """
import os, time
while True:
    try:
        pid = os.fork()
    except OSError:
        time.sleep(0.05)
        continue
    if pid:
        os.write(1, b"+")
"""


@pytest.mark.parametrize("name,max_processes", [("default", 0), ("os_only", 0), ("os_only", 3)])
def test_fork_bomb_is_contained(name, max_processes):
    r = run_program(FORK_BOMB, cpu_s=1, wall_s=1.5, max_processes=max_processes, **config(name))
    assert r.status == "timeout"  # it never stops trying; the wall limit ends it
    assert r.stdout.count("+") <= max_processes  # forks beyond the limit all failed
    if max_processes and name == "os_only":
        # it could fork (so RLIMIT_NPROC, counted per uid host-wide, is what stopped it)
        assert r.stdout.count("+") >= 1
    assert live_group_members(r.pgid) == []  # nothing it started outlived the run
    if OS_LAYERS:
        assert processes_of_uid(65534) == []
    assert_host_fine()


@pytest.mark.parametrize("code", [
    "data = []\nwhile True:\n    data.append(bytearray(1 << 20))\n",
    "x = bytearray(10 ** 10)\n",
])
def test_memory_hog_gets_memory_status(code):
    r = run_program(code, memory_mb=128, cpu_s=2, wall_s=20)
    assert r.status == "memory" and "MemoryError" in r.stderr
    assert_host_fine()


@pytest.mark.parametrize("name", ["default", "os_only"])
def test_writes_outside_the_working_directory_fail(name):
    targets = [f"/tmp/outside-{uuid.uuid4().hex}",
               str(Path(__file__).resolve().parent / f"outside-{uuid.uuid4().hex}.txt")]
    try:
        for target in targets:
            code = f"open({target!r}, 'w').write('pwned')\nprint('wrote')\n"
            r = run_program(code, **config(name))
            assert r.status == "error" and "wrote" not in r.stdout, (target, r)
            # refused (guard, read-only mount), or invisible: a checkout under /tmp is hidden
            # behind the sandbox's private /tmp, so the folder does not even exist in there
            assert any(e in r.stderr for e in ("PermissionError", "Read-only file system",
                                                "No such file or directory")), r.stderr
            assert not os.path.exists(target)
        # removing or renaming a host file is refused too
        victim = Path(__file__).resolve().parent / f"victim-{uuid.uuid4().hex}.txt"
        victim.write_text("keep")
        r = run_program(f"import os\nos.remove({str(victim)!r})\n", **config(name))
        assert r.status == "error" and victim.read_text() == "keep"
        victim.unlink()
    finally:
        for target in targets:
            if os.path.exists(target):
                os.remove(target)


def test_files_too_large_are_refused():
    r = run_program("open('big', 'wb').write(b'x' * (3 << 20))\n", file_size_mb=1)
    assert r.status == "error" and "File too large" in r.stderr


def test_huge_output_is_truncated():
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 10000)\n" \
           "sys.stderr.write('e' * 50000)\n"
    r = run_program(code, output_cap=1000)
    assert r.status == "ok"
    assert r.stdout == "x" * 1000 and r.stdout_truncated
    assert r.stderr == "e" * 1000 and r.stderr_truncated


def test_endless_output_is_killed():
    r = run_program("while True:\n    print('y' * 1000)\n", max_output_bytes=1 << 20, wall_s=20)
    assert r.status == "output_limit" and r.stdout_truncated
    assert live_group_members(r.pgid) == []


@pytest.mark.parametrize("name", ["default", "os_only"])
def test_network_is_unreachable(name):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = ("import socket\n"
                f"s = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\n"
                "print('connected')\n")
        r = run_program(code, **config(name))
        assert r.status == "error" and "connected" not in r.stdout
        if name == "os_only":
            assert "Network is unreachable" in r.stderr  # no loopback in the new namespace
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever reached the listening socket
    finally:
        server.close()


@pytest.mark.parametrize("code,needle", [
    ("import subprocess\nsubprocess.run(['true'])\n", "importing _posixsubprocess"),
    ("import os\nos.system('true')\n", "os.system"),
    ("import ctypes\n", "importing ctypes"),
    ("import os\nos.kill(os.getpid(), 0)\n", "os.kill"),
])
def test_guard_refuses_escape_hatches(code, needle):
    r = run_program(code, isolation="basic")  # the guard alone
    assert r.status == "error" and needle in r.stderr


def test_guard_off_requires_an_enforced_process_limit():
    with pytest.raises(SandboxError, match="guard=False"):
        run_program("print(1)", isolation="basic", guard=False, uid=None)


# ------------------------------------------------------------------------------ code rewards


def test_extract_code_and_run_tests():
    text = "Here:\n```python\nprint(int(input()) * 2)\n```\nand ```text\nnope\n```"
    code = extract_code(text)
    assert code == "print(int(input()) * 2)\n"
    assert extract_code("```py\nprint(1)") == "print(1)\n"  # unclosed fence
    assert extract_code("print(2)") == "print(2)\n"
    assert outputs_match("4 \n\n", "4") and not outputs_match("4", "5")
    tests = [{"input": "2\n", "output": "4"}, {"input": "5\n", "output": "11"},
             {"input": "x\n", "output": "?"}]
    report = run_tests(code, tests, workers=2, cpu_s=1)
    assert (report.passed, report.total) == (1, 3) and not report.all_passed
    by_index = {f.index: f for f in report.failures}
    assert by_index[1].got == "10\n" and by_index[1].status == "ok"
    assert by_index[2].status == "error" and "ValueError" in by_index[2].stderr
    with pytest.raises(TypeError, match=r"tests\[0\]\.output"):
        run_tests(code, [{"input": "1", "output": 2}])
