"""astralight.launch.proc: children spawned through it die with their parent, even a SIGKILLed one.

Real processes: an intermediate Python process spawns a sleeper and is then SIGKILLed; the sleeper
must be gone within a generous deadline (no speed assert). The control (``die_with_parent=False``)
shows the test can fail: that sleeper survives its parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from astralight.launch.proc import ORPHANED_AT_START, PDEATHSIG_SUPPORTED, child_setup, spawn
from tests.proc_helpers import gone, kill_quietly, wait_for

REPO = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not PDEATHSIG_SUPPORTED, reason="parent-death signal is Linux-only")

SLEEPER = "import time\nwhile True: time.sleep(0.1)\n"


def start_intermediate(tmp_path: Path, die_with_parent: bool) -> tuple[subprocess.Popen, int]:
    """A parent process that spawns a sleeper through astralight.launch.proc and prints its pid."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    middle = tmp_path / "middle.py"
    middle.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from astralight.launch.proc import spawn
        child = spawn([sys.executable, {str(tmp_path / 'sleeper.py')!r}],
                      die_with_parent={die_with_parent!r})
        print(child.pid, flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(middle)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line.isdigit(), f"the intermediate process printed {line!r}"
    return proc, int(line)


@linux_only
def test_a_child_dies_when_its_parent_is_sigkilled(tmp_path):
    parent, child = start_intermediate(tmp_path, die_with_parent=True)
    try:
        assert not gone(child)
        parent.kill()
        parent.wait()
        wait_for(lambda: gone(child), "the child of a SIGKILLed parent to exit")
    finally:
        kill_quietly(child)
        if parent.poll() is None:
            parent.kill()


@linux_only
def test_control_without_die_with_parent_the_child_survives(tmp_path):
    parent, child = start_intermediate(tmp_path, die_with_parent=False)
    try:
        parent.kill()
        parent.wait()
        time.sleep(1.0)  # long enough for a parent-death signal to have arrived, were it armed
        assert not gone(child), "a child spawned with die_with_parent=False should outlive its parent"
    finally:
        kill_quietly(child)
        if parent.poll() is None:
            parent.kill()


@linux_only
def test_a_child_whose_parent_died_before_prctl_exits_at_once():
    """The race: the setup compares getppid() with the parent's pid taken before the fork. Here it
    runs in a grandchild, whose parent is not the process that made the setup."""
    setup = child_setup()
    pid = os.fork()
    if pid == 0:  # the middle process: run the setup in a child of its own, exit with its status
        try:
            inner = os.fork()
            if inner == 0:
                setup()
                os._exit(0)  # not reached when the check works
            _, status = os.waitpid(inner, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        finally:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == ORPHANED_AT_START


def test_setup_pins_cpus_and_spawn_passes_popen_arguments(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[-1:]
    child = spawn([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                  cpus=cpus, stdout=subprocess.PIPE, text=True)
    text, _ = child.communicate(timeout=30)
    assert text.strip() == str(cpus) and child.returncode == 0
    with pytest.raises(TypeError, match="preexec_fn"):
        spawn(["true"], preexec_fn=lambda: None)


@linux_only
def test_spawn_refuses_a_daemon_thread_unless_told_it_outlives_the_children():
    errors: list[BaseException] = []

    def run():
        try:
            spawn([sys.executable, "-c", "pass"])
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True, name="short-lived")
    t.start()
    t.join()
    assert errors and "short-lived" in str(errors[0]) and "from_thread_ok" in str(errors[0])
    # die_with_parent=False has no such pitfall
    out: list[subprocess.Popen] = []
    t = threading.Thread(target=lambda: out.append(spawn([sys.executable, "-c", "pass"],
                                                         die_with_parent=False)), daemon=True)
    t.start()
    t.join()
    assert out and out[0].wait(timeout=30) == 0


@linux_only
def test_the_thread_pitfall_a_child_dies_when_its_forking_thread_exits(tmp_path):
    """Why the launcher and the autoscaler spawn only from their long-lived loop thread: Linux
    sends the parent-death signal when the forking *thread* exits, the process still alive."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    out: list[subprocess.Popen] = []
    t = threading.Thread(target=lambda: out.append(
        spawn([sys.executable, str(tmp_path / "sleeper.py")], from_thread_ok=True)))
    t.start()
    t.join()
    child = out[0]
    try:
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
