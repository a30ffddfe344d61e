"""kill -9 of ``astralight run`` mid-run leaves no stray process (real dataflow, vLLM RaaS, trainer).

The launcher is SIGKILLed once the run trains; every component it started (and the processes of
their groups: a trainer's weight encoder) must exit by themselves -- the kernel's parent-death
signal, SIGTERM for services, SIGINT for the trainer (Lightning's graceful stop) -- within a
generous deadline, and the folder is then resumable (``--resume`` refuses while components run).
Measured here (2 shared cores): trainer 0.2 s, dataflow 1 s, RaaS 10 s (it drains).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from astralight.launch import running_components
from astralight.launch.proc import PDEATHSIG_SUPPORTED
from tests.integration.recipes import shortened_toy_recipe
from tests.proc_helpers import gone, kill_quietly, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow,  # a real toy run, ~45 s: the slow suite
              pytest.mark.skipif(not PDEATHSIG_SUPPORTED, reason="parent-death signal is Linux-only")]


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (each component has a session of its own)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def test_kill9_of_the_launcher_stops_every_component(tmp_path):
    recipe = shortened_toy_recipe(tmp_path, versions=100000, batch_size=16)  # never finishes
    run_dir = tmp_path / "run"
    out = tmp_path / "launcher.out"
    launcher = subprocess.Popen([sys.executable, "-m", "astralight.cli", "run", str(recipe),
                                 "--run-dir", str(run_dir)], stdout=open(out, "wb"),
                                stderr=subprocess.STDOUT)
    procs: list[int] = []
    try:
        def training() -> bool:
            assert launcher.poll() is None, out.read_text(errors="replace")[-3000:]
            versions = re.findall(r"version (\d+)/", out.read_text(errors="replace"))
            return bool(versions) and int(versions[-1]) >= 2

        wait_for(training, "the run to train a few versions", timeout=400)
        pids = json.loads((run_dir / "pids.json").read_text())
        assert sorted(pids) == ["dataflow", "raas-0", "trainer-policy"]
        procs = sorted({p for pid in pids.values() for p in group_members(pid)} | set(pids.values()))
        assert not any(gone(p) for p in procs)

        names = {p: cmdline(p) for p in procs}
        launcher.kill()
        launcher.wait()
        try:
            wait_for(lambda: all(gone(p) for p in procs), "every component of the killed "
                     "launcher to exit", timeout=90)
        except AssertionError as exc:
            left = {p: names[p] for p in procs if not gone(p)}
            logs = {f.name: f.read_text(errors="replace")[-1500:]
                    for f in sorted((run_dir / "logs").glob("*.log"))}
            raise AssertionError(f"{exc}; still running: {left}; logs: {logs}") from None
        assert running_components(run_dir) == {}  # `astralight run --resume` may go on
        log = (run_dir / "logs" / "trainer-policy.log").read_text(errors="replace")
        assert "KeyboardInterrupt" in log or "graceful shutdown" in log  # stopped by SIGINT
    finally:
        for p in procs:
            kill_quietly(p)
        if launcher.poll() is None:
            launcher.kill()
