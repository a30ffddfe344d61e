"""kill -9 of ``astralight autoscale`` leaves no stray RaaS, and a restarted one does not double
the pool. Real processes on loopback: the dataflow service, the autoscaler's command line, and
stand-in RaaS processes that register with the dataflow, heartbeat, and on a drain (heartbeat
reply) or SIGTERM deregister and exit (a real RaaS's behaviour, without vLLM).

1. Local backend: the autoscaler starts two instances as its children and is SIGKILLed; both get
   SIGTERM from the kernel (parent-death signal), deregister and exit.
2. Command backend (how Slurm / kubectl run it): instances are detached jobs that outlive the
   autoscaler on purpose. After a kill -9 and a restart, the new autoscaler adopts the two
   registered instances and launches none; on SIGTERM it drains both, and they exit.

Deadlines are generous (30-90 s); nothing asserts on speed.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from astralight.dataflow.client import DataflowClient
from astralight.launch.proc import PDEATHSIG_SUPPORTED
from tests.proc_helpers import gone, wait_for

REPO = Path(__file__).resolve().parents[2]

FAKE_RAAS = textwrap.dedent("""
    # stand-in for `astralight raas serve --dataflow URL --instance_id ID`: registers, heartbeats,
    # and on a drain (heartbeat reply) or SIGTERM deregisters and exits 0
    import os, signal, sys, time
    from pathlib import Path
    sys.path.insert(0, os.environ["REPO"])
    from astralight.dataflow.client import DataflowClient
    args = sys.argv[1:]
    url = args[args.index("--dataflow") + 1]
    iid = args[args.index("--instance_id") + 1]
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append("SIGTERM"))
    client = DataflowClient(url, retry_s=5.0, timeout=5.0)
    client.register(["policy"], 2, instance_id=iid)
    Path(f"{iid}.pid").write_text(str(os.getpid()))
    while not stop:
        if client.heartbeat(iid).get("drain"):
            stop.append("drain")
        time.sleep(0.2)
    client.deregister(iid)
    print(f"{iid}: left on {stop[0]}", flush=True)
""")

DRIVER = textwrap.dedent("""
    # `astralight autoscale` (its real main: arguments, signals, loop on the main thread) with the
    # local backend starting the stand-in instead of `astralight.cli raas serve`
    import os, sys
    sys.path.insert(0, os.environ["REPO"])
    import astralight.autoscale.backends as backends
    from astralight.autoscale.service import main
    init = backends.LocalProcessBackend.__init__
    def patched(self, *a, **kw):
        kw["argv_prefix"] = [sys.executable, os.environ["FAKE_RAAS"]]
        init(self, *a, **kw)
    backends.LocalProcessBackend.__init__ = patched
    sys.exit(main(sys.argv[1:]))
""")


def table(client: DataflowClient) -> dict[str, dict]:
    return {r["instance_id"]: r for r in client.stats()["instances"]}


def live(client: DataflowClient) -> list[str]:
    return sorted(i for i, r in table(client).items() if r["status"] in ("healthy", "suspect"))


def pid_of(folder: Path, iid: str) -> int:
    return int((folder / f"{iid}.pid").read_text())


@pytest.fixture
def setup(tmp_path, dataflow_service):
    svc = dataflow_service(tmp_path, lease_seconds=30.0)
    (tmp_path / "fake_raas.py").write_text(FAKE_RAAS)
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "raas.yaml").write_text("max_concurrency: 2\n")
    env = {**os.environ, "REPO": str(REPO), "FAKE_RAAS": str(tmp_path / "fake_raas.py")}
    client = DataflowClient(svc.url, retry_s=10.0, timeout=10.0)
    procs: list[subprocess.Popen] = []
    yield svc.url, client, env, procs
    for p in procs:  # autoscalers still running
        if p.poll() is None:
            p.kill()
            p.wait()
    for pid_file in tmp_path.glob("*.pid"):  # and any instance (a failed test's leftovers)
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    client.close()


def common_args(url: str, tmp_path: Path) -> list[str]:
    return ["--dataflow", url, "--model-id", "policy", "--min", "2", "--max", "3",
            "--initial", "2", "--every", "1000", "--cooldown-s", "0", "--poll-s", "0.2",
            "--log-dir", str(tmp_path / "logs"), "--drain-timeout-s", "30", "--kill-after-s", "10"]


@pytest.mark.skipif(not PDEATHSIG_SUPPORTED, reason="parent-death signal is Linux-only")
def test_kill9_of_the_autoscaler_stops_the_local_instances_it_started(tmp_path, setup):
    url, client, env, procs = setup
    argv = [sys.executable, str(tmp_path / "driver.py"), *common_args(url, tmp_path),
            "--backend", "local", "--raas-config", str(tmp_path / "raas.yaml")]
    scaler = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=open(tmp_path / "a.log", "wb"),
                              stderr=subprocess.STDOUT)
    procs.append(scaler)
    wait_for(lambda: live(client) == ["auto-0", "auto-1"]
             and all((tmp_path / f"auto-{k}.pid").exists() for k in (0, 1)),
             "the two instances to register", timeout=60)
    pids = [pid_of(tmp_path, f"auto-{k}") for k in (0, 1)]
    assert not any(gone(p) for p in pids)

    scaler.kill()  # SIGKILL: no handler runs, the autoscaler cannot retire anything itself
    scaler.wait()
    wait_for(lambda: all(gone(p) for p in pids), "the orphaned instances to exit", timeout=30)
    # they stopped as on a polite stop: deregistered (SIGTERM), nothing left registered
    rows = table(client)
    assert [rows[f"auto-{k}"]["state"] for k in (0, 1)] == ["left", "left"]
    for k in (0, 1):
        assert f"auto-{k}: left on SIGTERM" in (tmp_path / "logs" / f"auto-{k}.log").read_text()


def test_a_restarted_autoscaler_adopts_the_cluster_pool_instead_of_doubling_it(tmp_path, setup):
    url, client, env, procs = setup
    py, fake = shlex.quote(sys.executable), shlex.quote(str(tmp_path / "fake_raas.py"))
    # a detached job per instance (as sbatch / kubectl would start it): outlives the autoscaler
    launch = (f"setsid {py} {fake} --dataflow {url} --instance_id {{instance}} "
              f"> {{instance}}.out 2>&1 < /dev/null & "
              f"for i in $(seq 300); do [ -f {{instance}}.pid ] && break; sleep 0.1; done")
    retire = "kill -TERM $(cat {instance}.pid) 2>/dev/null || true"
    alive = "kill -0 $(cat {instance}.pid) 2>/dev/null"
    argv = [sys.executable, "-m", "astralight.cli", "autoscale", *common_args(url, tmp_path),
            "--backend", "command", "--launch-cmd", launch, "--retire-cmd", retire,
            "--alive-cmd", alive]

    first = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=open(tmp_path / "a1.log", "wb"),
                             stderr=subprocess.STDOUT)
    procs.append(first)
    decisions = tmp_path / "logs" / "autoscale-decisions.jsonl"
    wait_for(lambda: live(client) == ["auto-0", "auto-1"] and decisions.exists(),
             "the first pool to register", timeout=60)
    pids = {f"auto-{k}": pid_of(tmp_path, f"auto-{k}") for k in (0, 1)}
    first.kill()
    first.wait()
    time.sleep(1.0)
    assert not any(gone(p) for p in pids.values()), "cluster jobs outlive the autoscaler"
    assert live(client) == ["auto-0", "auto-1"]

    before = len(decisions.read_text().splitlines())
    second = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=open(tmp_path / "a2.log", "wb"),
                              stderr=subprocess.STDOUT)
    procs.append(second)

    def new_entries() -> list[dict]:
        return [json.loads(x) for x in decisions.read_text().splitlines()[before:]]

    wait_for(lambda: any(e["action"] == "adopt" for e in new_entries()), "the adoption", timeout=60)
    time.sleep(3.0)  # ~15 polls: room to launch, had it wanted to
    entries = new_entries()
    assert entries[0]["action"] == "adopt" and sorted(entries[0]["adopted"]) == ["auto-0", "auto-1"]
    assert [i for e in entries for i in e["launched"]] == []
    assert live(client) == ["auto-0", "auto-1"]
    assert not list(tmp_path.glob("auto-2*")), "no instance launched on restart"

    second.send_signal(signal.SIGTERM)  # retires what it owns: the adopted pool
    assert second.wait(timeout=90) == 0, (tmp_path / "a2.log").read_text()[-3000:]
    wait_for(lambda: all(gone(p) for p in pids.values()), "the adopted instances to exit", timeout=30)
    rows = table(client)
    assert [rows[i]["state"] for i in ("auto-0", "auto-1")] == ["left", "left"]
    shutdown = new_entries()[-1]
    assert shutdown["action"] == "shutdown" and sorted(shutdown["retire"]) == ["auto-0", "auto-1"]
