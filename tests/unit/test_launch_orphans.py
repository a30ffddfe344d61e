"""kill -9 of the launcher leaves no stray component: ``launch.Component`` children die with it.

Real processes: an intermediate process plays the launcher (it starts two components through
``astralight.launch.Component``, one of them restarted once as the supervisor would, from the same
thread) and is SIGKILLed; every component must be gone within a generous deadline, having got
SIGTERM (each stand-in writes which signal stopped it). The same for the fault harness's Component.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from astralight.launch.proc import PDEATHSIG_SUPPORTED
from tests.proc_helpers import gone, kill_quietly, wait_for

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not PDEATHSIG_SUPPORTED, reason="parent-death signal is Linux-only")

SERVICE = textwrap.dedent("""
    # stand-in component: records its pid, and which signal stopped it (SIGTERM by its handler,
    # SIGINT by Python's default KeyboardInterrupt, as a Lightning trainer stops gracefully)
    import os, signal, sys, time
    name = sys.argv[1]
    def stop(signum, frame):
        open(f"{name}.stopped", "w").write(signal.Signals(signum).name)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    open(f"{name}.pid", "w").write(str(os.getpid()))
    try:
        while True:
            time.sleep(0.1)
    except KeyboardInterrupt:
        open(f"{name}.stopped", "w").write("SIGINT")
""")

LAUNCHER = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    # started like `nohup astralight run ... &`: SIGINT ignored, which children would inherit
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path.insert(0, {repo!r})
    from {module} import Component
    NAMES = ("dataflow", "raas-0", "trainer-policy")
    here = Path.cwd()
    comps = [Component(name=n, argv=[sys.executable, str(here / "service.py"), n],
                       log_path=here / "logs" / f"{{n}}.log") for n in NAMES]
    for c in comps:
        c.start()
    for n in NAMES:
        while not (here / f"{{n}}.pid").exists():
            time.sleep(0.05)
    # a restart, as the supervisor does it on the launcher's loop thread
    comps[1].proc.kill(); comps[1].proc.wait(); (here / "raas-0.pid").unlink()
    comps[1].start()
    while not (here / "raas-0.pid").exists():
        time.sleep(0.05)
    print("ready", flush=True)
    time.sleep(600)
""")


NAMES = ("dataflow", "raas-0", "trainer-policy")


@pytest.mark.parametrize("module,trainer_signal", [("astralight.launch", "SIGINT"),
                                                   ("tests.fault_harness", "SIGINT")])
def test_components_stop_when_the_launcher_is_sigkilled(tmp_path, module, trainer_signal):
    """The launcher's trainers get SIGINT, as on its own stop (Lightning's graceful stop), even
    though the launcher ignored SIGINT: the death signal is reset to its default in the child."""
    (tmp_path / "service.py").write_text(SERVICE)
    (tmp_path / "launcher.py").write_text(LAUNCHER.format(repo=str(REPO), module=module))
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py")], cwd=tmp_path,
                                stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert launcher.stdout.readline().strip() == "ready"
        pids = [int((tmp_path / f"{n}.pid").read_text()) for n in NAMES]
        assert not any(gone(p) for p in pids)
        launcher.kill()
        launcher.wait()
        wait_for(lambda: all(gone(p) for p in pids), "the components of a SIGKILLed launcher to exit")
        # a polite stop, each by the signal it is stopped with
        stopped = {n: (tmp_path / f"{n}.stopped").read_text() for n in NAMES}
        assert stopped == {"dataflow": "SIGTERM", "raas-0": "SIGTERM",
                           "trainer-policy": trainer_signal}
    finally:
        for p in pids:
            kill_quietly(p)
        if launcher.poll() is None:
            launcher.kill()
