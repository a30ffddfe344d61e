"""Autoscaler backends: shell templates (echo / touch-file commands) and local processes (a small
stand-in for ``raas serve`` that records its arguments and drains on request or signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from astralight.autoscale.backends import (BackendError, CommandBackend, LocalProcessBackend,
                                           render)
from tests.fakes import FakeDrainClient as FakeClient
from tests.fakes import FileDrainClient


def test_render_substitutes_instance_and_n_and_leaves_other_braces():
    assert render("sbatch -J {instance} --array={n} x ${HOME} {other}", "auto-3", 5) == \
        "sbatch -J auto-3 --array=5 x ${HOME} {other}"
    assert render("scancel {instance}", "auto-0", None) == "scancel auto-0"


# ---------------------------------------------------------------------- command templates


def test_command_backend_runs_templates_with_substitution(tmp_path):
    client = FakeClient()
    backend = CommandBackend(
        launch="echo {instance} {n} >> launched.txt && touch {instance}.up",
        retire="echo {instance} {n} >> retired.txt && rm {instance}.up",
        alive="test -e {instance}.up", cwd=tmp_path, client_factory=lambda: client)
    assert backend.alive("auto-0") is False
    backend.launch("auto-0", n=1)
    backend.launch("auto-1", n=2)
    assert backend.alive("auto-0") and backend.alive("auto-1")
    backend.retire("auto-0", n=1)
    assert not backend.alive("auto-0") and backend.alive("auto-1")
    assert (tmp_path / "launched.txt").read_text().split("\n")[:2] == ["auto-0 1", "auto-1 2"]
    assert (tmp_path / "retired.txt").read_text().strip() == "auto-0 1"
    assert client.drained == ["auto-0"] and client.closed == 1  # drained before the command
    assert "echo auto-0 1 >> retired.txt && rm auto-0.up" in backend.commands


def test_command_backend_without_alive_template_cannot_tell():
    backend = CommandBackend(launch="true", retire="true")
    assert backend.alive("auto-0") is None


def test_command_backend_failure_names_the_command_and_its_output(tmp_path):
    backend = CommandBackend(launch="echo no quota >&2; exit 3", retire="true", cwd=tmp_path)
    with pytest.raises(BackendError, match=r"launch command for auto-0 failed \(exit 3\)[\s\S]*no quota"):
        backend.launch("auto-0", n=1)
    slow = CommandBackend(launch="sleep 5", retire="true", timeout_s=0.2)
    with pytest.raises(BackendError, match="ran past"):
        slow.launch("auto-1")


def test_command_backend_drain_failure_still_runs_the_retire_command(tmp_path):
    said = []
    backend = CommandBackend(launch="true", retire="touch {instance}.retired", cwd=tmp_path,
                             client_factory=lambda: FakeClient(fail=True), say=said.append)
    backend.retire("auto-2", n=0)
    assert (tmp_path / "auto-2.retired").exists()
    assert "drain route failed" in said[0]


@pytest.mark.parametrize("kwargs, field", [({"launch": "", "retire": "x"}, "launch"),
                                           ({"launch": "x", "retire": None}, "retire"),
                                           ({"launch": "x", "retire": "y", "alive": " "}, "alive")])
def test_command_backend_requires_templates(kwargs, field):
    with pytest.raises(BackendError, match=f"^{field}:"):
        CommandBackend(**kwargs)


# ---------------------------------------------------------------------- local processes

FAKE_RAAS = textwrap.dedent("""
    # stand-in for `astralight.cli raas serve ...`: records its argv, affinity and pid, then
    # runs until drained (a file named DRAIN-<instance> appears) or signalled
    import json, os, signal, sys, time
    args = sys.argv[1:]
    iid = args[args.index("--instance_id") + 1]
    mode = os.environ.get("FAKE_MODE", "obey")
    out = {"argv": args, "pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)),
           "env": os.environ.get("FAKE_TAG")}
    open(f"{iid}.json", "w").write(json.dumps(out))
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    while True:
        if mode == "obey" and os.path.exists(f"DRAIN-{iid}"):
            sys.exit(0)
        time.sleep(0.05)
""")


def wait_for(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def local(tmp_path, monkeypatch):
    script = tmp_path / "fake_raas.py"
    script.write_text(FAKE_RAAS)
    cfg = tmp_path / "raas.yaml"
    cfg.write_text("max_concurrency: 4\n")
    monkeypatch.chdir(tmp_path)
    drained: list[str] = []
    made = []

    def make(**kw):
        kw.setdefault("client_factory", lambda: FileDrainClient(tmp_path, drained))
        backend = LocalProcessBackend(cfg, "http://127.0.0.1:1", tmp_path / "logs",
                                      argv_prefix=[sys.executable, str(script)], **kw)
        made.append(backend)
        return backend

    make.drained = drained
    make.cfg = cfg
    yield make
    for backend in made:
        backend.drain_timeout_s = 0.0
        backend.close()


def read_json(path: Path) -> dict:
    wait_for(path.exists, f"{path.name}")
    time.sleep(0.05)
    return json.loads(path.read_text())


def test_local_launch_runs_raas_serve_with_its_instance_id_and_log(local, tmp_path):
    backend = local(env={"FAKE_TAG": "x"})
    proc = backend.launch("auto-0", n=1)
    info = read_json(tmp_path / "auto-0.json")
    assert info["argv"] == ["raas", "serve", "--dataflow", "http://127.0.0.1:1", "--config",
                            str(local.cfg), "--instance_id", "auto-0"]
    assert info["env"] == "x" and info["pid"] == proc.pid
    assert backend.alive("auto-0") and (tmp_path / "logs" / "auto-0.log").exists()
    with pytest.raises(BackendError, match="already running"):
        backend.launch("auto-0")
    assert backend.argv("auto-7")[:3] == [sys.executable, str(tmp_path / "fake_raas.py"), "raas"]


def test_local_default_argv_is_the_astralight_cli(tmp_path):
    cfg = tmp_path / "raas.yaml"
    cfg.write_text("{}\n")
    backend = LocalProcessBackend(cfg, "http://h:1", tmp_path)
    assert backend.argv("auto-1") == [sys.executable, "-m", "astralight.cli", "raas", "serve",
                                      "--dataflow", "http://h:1", "--config", str(cfg),
                                      "--instance_id", "auto-1"]
    with pytest.raises(BackendError, match="raas_config"):
        LocalProcessBackend(tmp_path / "missing.yaml", "http://h:1", tmp_path)


def test_local_retire_drains_through_the_route_and_waits_for_exit(local, tmp_path):
    backend = local(drain_timeout_s=60)
    backend.launch("auto-0")
    backend.launch("auto-1")
    read_json(tmp_path / "auto-0.json")
    backend.retire("auto-0", n=1, wait=True)
    assert local.drained == ["auto-0"]
    assert not backend.alive("auto-0") and backend.alive("auto-1")
    assert backend.events == [{"instance_id": "auto-0", "how": "drained", "exit_code": 0,
                               "seconds": backend.events[0]["seconds"]}]
    with pytest.raises(BackendError, match="not started by this backend"):
        backend.retire("someone-else")


def test_local_retire_sigterm_after_drain_timeout_then_sigkill(local, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "ignore_drain")
    backend = local(drain_timeout_s=0.3, kill_after_s=30)
    backend.launch("auto-0")
    read_json(tmp_path / "auto-0.json")
    backend.retire("auto-0", wait=True)
    assert backend.events[-1]["how"] == "SIGTERM" and backend.events[-1]["exit_code"] == 0

    monkeypatch.setenv("FAKE_MODE", "ignore_term")
    stubborn = local(drain_timeout_s=0.2, kill_after_s=0.3)
    stubborn.launch("auto-1")
    read_json(tmp_path / "auto-1.json")
    stubborn.retire("auto-1", wait=True)
    assert stubborn.events[-1]["how"] == "SIGKILL"
    assert stubborn.events[-1]["exit_code"] == -signal.SIGKILL


def test_local_retire_of_an_unregistered_instance_sends_sigterm_at_once(local, tmp_path):
    said = []

    class Refusing(FakeClient):
        pass

    backend = local(drain_timeout_s=600, client_factory=lambda: Refusing(fail=True),
                    say=said.append)
    backend.launch("auto-0")
    read_json(tmp_path / "auto-0.json")
    backend.retire("auto-0", wait=True)  # does not wait the 600 s drain timeout
    assert backend.events[-1]["how"] == "SIGTERM"
    assert "drain route failed" in said[0]


def test_local_children_pinned_to_cpus(local, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    backend = local(cpus=cpus[-1:])
    backend.launch("auto-0")
    assert read_json(tmp_path / "auto-0.json")["cpus"] == cpus[-1:]


def test_local_children_stop_when_the_autoscaler_dies(local, tmp_path):
    """A killed autoscaler leaves no orphan RaaS: children get SIGTERM (parent-death signal)."""
    middle = tmp_path / "middle.py"
    middle.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from astralight.autoscale.backends import LocalProcessBackend
        b = LocalProcessBackend({str(local.cfg)!r}, "http://127.0.0.1:1", "logs",
                                argv_prefix=[sys.executable, "fake_raas.py"])
        b.launch("auto-9")
        print("launched", flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(middle)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "launched"
        child = read_json(tmp_path / "auto-9.json")["pid"]
        proc.kill()
        proc.wait()

        def gone():
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            # a zombie re-parented to init is gone too
            try:
                return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
            except OSError:
                return True
        wait_for(gone, "the orphaned child to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
