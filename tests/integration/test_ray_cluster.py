"""The Ray backend on real Ray: a one-node cluster from ``ray start`` and a simulated three-node
cluster (``ray.cluster_utils.Cluster``: three raylets on this machine, the two workers with two
fake GPUs each: Ray counts and assigns them, vLLM and the trainer run on the CPU).

1. The ``ray start`` / ``ray stop`` lines of ``examples/cluster/README.md``'s Ray steps make a
   cluster with the GPUs the launch asks for, and end it.
2. The steps' ``astralight run --backend ray`` line, verbatim (plus ``--run-dir``), on the
   three-node cluster: the RaaS and the trainer are placed on different nodes with a GPU each; the
   RaaS actor is killed mid-run (``ray.kill``) and the launcher's supervision restarts it in a new
   actor; the toy still learns (real dataflow, vLLM on CPU, Lightning).
3. The autoscaler's Ray backend against a real dataflow and real RaaS actors: a killed instance is
   replaced, the pool grows to two and shrinks to one (the retired instance drains, deregisters
   and exits 0), shutdown retires the rest, and every placement group is removed.

Slow: marked ``slow``. On two idle cores the module takes about 10 minutes (most of it the toy's
warm start and vLLM start-ups); on a loaded machine far longer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray", reason="the ray extra: pip install -e '.[ray]'")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "examples" / "cluster" / "README.md"


def readme_steps() -> list[str]:
    """The commands of the README's Ray steps (the bash block after ``check: ray-steps``)."""
    text = README.read_text()
    block = re.search(r"<!-- check: ray-steps -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "examples/cluster/README.md lost its Ray steps block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def step(prefix: str) -> str:
    found = [line for line in readme_steps() if line.startswith(prefix)]
    assert len(found) == 1, (prefix, readme_steps())
    return found[0]


def wait_for(what: str, check, timeout_s: float, every_s: float = 1.0):
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout_s``
    (a bound on a hang, not a speed requirement: generous, for a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")


def test_readme_ray_start_and_stop_lines(tmp_path):
    """``ray start --head ...`` gives a cluster with the README's CPUs and GPUs; ``ray stop``
    ends it (runs before the simulated cluster below exists)."""
    start, stop = step("ray start"), step("ray stop")
    # a session folder of its own, short (Ray's socket paths must fit 107 bytes)
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}
    out = subprocess.run(shlex.split(start), capture_output=True, text=True, env=env, timeout=180)
    try:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        probe = subprocess.run(
            [sys.executable, "-c", "import json, ray; ray.init(address='auto', "
             "log_to_driver=False); print(json.dumps(ray.cluster_resources()))"],
            capture_output=True, text=True, env=env, timeout=120)
        assert probe.returncode == 0, probe.stderr[-2000:]
        resources = json.loads(probe.stdout.strip().splitlines()[-1])
        assert resources["GPU"] == 2 and resources["CPU"] == 4
    finally:
        done = subprocess.run(shlex.split(stop), capture_output=True, text=True, env=env,
                              timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _start_cluster(attempts: int = 3):
    """The three nodes. Ray gives a raylet a fixed 30 s to register (``ray/_private/node.py``),
    which a heavily loaded machine can miss: the cluster is then started afresh, up to
    ``attempts`` times (the start-up only; nothing the tests assert)."""
    from ray.cluster_utils import Cluster

    for attempt in range(1, attempts + 1):
        c = Cluster()
        try:
            c.add_node(num_cpus=2, num_gpus=0, include_dashboard=False)  # the head
            workers = [c.add_node(num_cpus=2, num_gpus=2) for _ in range(2)]
            c.wait_for_nodes()
            return c, workers
        except Exception:
            c.shutdown()
            if attempt == attempts:
                raise


@pytest.fixture(scope="module")
def cluster():
    """Three Ray nodes on this machine: a head without GPUs (the launcher's node: the dataflow),
    two workers with 2 CPUs and 2 fake GPUs each. This process is its driver (``ray.kill``)."""
    c, workers = _start_cluster()
    ray.init(address=c.address, namespace="astralight", log_to_driver=False)
    try:
        yield c, [w.node_id for w in workers]
    finally:
        ray.shutdown()
        c.shutdown()


def _progress_version(launch_log: Path) -> int:
    versions = re.findall(r"\] version (\d+)/", launch_log.read_text() if launch_log.exists() else "")
    return int(versions[-1]) if versions else 0


def test_readme_run_learns_on_three_nodes_with_its_raas_actor_killed(cluster, tmp_path):
    c, worker_nodes = cluster
    argv = shlex.split(step("astralight run")) + ["--run-dir", str(tmp_path / "run")]
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": c.address,
           "ASTRALIGHT_TOKEN": secrets.token_hex(32)}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        # the RaaS serves (the run is past its first versions); then its actor is killed
        # (bounds on a hang, generous: the warm start alone took 70 s idle, 330 s on a
        # machine loaded 12-fold)
        wait_for("version 6 of the run", lambda: proc.poll() is not None
                 or _progress_version(run_dir / "launch.log") >= 6, timeout_s=1800)
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        actors = json.loads((run_dir / "ray_actors.json").read_text())
        killed = actors["raas-0"]["actor"]
        ray.kill(ray.get_actor(killed, namespace="astralight"), no_restart=True)
        out, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(out[-3000:])
    assert proc.returncode == 0, out[-4000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    # replaced: the launcher saw the actor die and restarted the RaaS in a new actor
    assert summary["restarts"]["raas-0"] == 1, summary["restart_events"]
    assert "[launch] raas-0: its Ray actor died" in out
    actors = json.loads((run_dir / "ray_actors.json").read_text())
    assert actors["raas-0"]["actor"] != killed and actors["raas-0"]["actor"].endswith(":1")
    assert "its Ray actor died" in (run_dir / "logs" / "raas-0.log").read_text()
    # placed across the cluster: RaaS and trainer each on a GPU node, on different nodes
    # (SPREAD), each with a GPU Ray assigned; the dataflow on the launcher's (head) node
    raas, trainer, dataflow = actors["raas-0"], actors["trainer-policy"], actors["dataflow"]
    assert {raas["node_id"], trainer["node_id"]} <= set(worker_nodes)
    assert raas["node_id"] != trainer["node_id"]
    assert raas["gpu_ids"] and trainer["gpu_ids"] and not dataflow["gpu_ids"]
    assert dataflow["node_id"] not in worker_nodes
    # the logs are where a local run keeps them, and the toy learned
    for name in ("dataflow", "raas-0", "trainer-policy"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    assert summary["versions"] == 30 and summary["stop_reason"] == "versions"
    start, end = summary["eval_accuracy_start"], summary["eval_accuracy_end"]
    assert start <= 0.40 and end - start >= 0.20, summary
    # the run's placement group is gone: the cluster's GPUs are free again
    assert wait_for("the run's GPUs back", lambda: ray.available_resources().get("GPU") == 4,
                    timeout_s=300)


def _raas_config(model_dir: Path) -> dict:
    return {"engines": {"policy": {"model_path": str(model_dir), "dtype": "bfloat16",
                                   "max_model_len": 128, "kv_cache_memory_bytes": 64 << 20}},
            "workflow": {"class_path": "astralight.workflows.single_turn.SingleTurnWorkflow",
                         "init_args": {"reward": {"class_path":
                                                  "astralight.rewards.toy.ExactMatchReward"},
                                       "sampling": {"temperature": 1.0, "max_tokens": 3}}},
            "max_concurrency": 4, "poll_interval_s": 0.05, "heartbeat_interval_s": 0.5,
            "progress_interval_s": 5.0, "seed": 0}


def test_autoscaler_ray_backend_replaces_grows_and_shrinks(cluster, tmp_path, tiny_model_dir,
                                                           dataflow_service):
    from astralight.autoscale.policy import Policy, PolicyConfig
    from astralight.autoscale.ray_backend import RayBackend
    from astralight.autoscale.service import AutoscaleConfig, Autoscaler
    from astralight.dataflow.client import DataflowClient

    c, _ = cluster
    # lease_seconds 8: a killed instance, which cannot deregister, is gone after 8 s
    svc = dataflow_service(tmp_path, group_size=2, lease_seconds=8)
    client = DataflowClient(svc.url, retry_s=10.0)
    config_path = tmp_path / "raas.yaml"
    config_path.write_text(yaml.safe_dump(_raas_config(tiny_model_dir)))
    backend = RayBackend(config_path, svc.url, tmp_path / "logs", address=c.address,
                         resources={"num_gpus": 1, "num_cpus": 0.5}, drain_timeout_s=300,
                         kill_after_s=20)
    policy = Policy(PolicyConfig(min_instances=1, max_instances=2, cooldown_s=0,
                                 replace_backoff_s=0))
    scaler = Autoscaler(policy, backend, client,
                        AutoscaleConfig(model_id="policy", every=1000, initial=1, poll_s=0.5,
                                        decisions_log=str(tmp_path / "decisions.jsonl")))

    def table() -> dict[str, dict]:
        return {r["instance_id"]: r for r in client.stats().get("instances") or []}

    def registered(iid: str) -> bool:
        scaler.step()
        row = table().get(iid)
        return bool(row) and row.get("status") == "healthy"

    try:
        scaler.start()
        assert scaler.started == ["auto-0"]
        wait_for("auto-0 registered", lambda: registered("auto-0"), timeout_s=900)

        # killed: the backend sees the actor gone, the autoscaler records it and, once the
        # dataflow no longer counts it live (lease_seconds), launches a replacement
        ray.kill(ray.get_actor("autoscale:auto-0", namespace="astralight"), no_restart=True)
        wait_for("auto-0 replaced", lambda: scaler.step() or "auto-1" in scaler.started,
                 timeout_s=300)
        actions = [d["action"] for d in scaler.decisions]
        assert "died" in actions and actions[-1] == "replace"
        wait_for("auto-1 registered", lambda: registered("auto-1"), timeout_s=900)

        # grow to two (the bounds say two), then shrink to one
        policy.config = dataclasses.replace(policy.config, min_instances=2)
        wait_for("a second instance", lambda: scaler.step() or "auto-2" in scaler.started,
                 timeout_s=300)
        wait_for("auto-2 registered", lambda: registered("auto-2"), timeout_s=900)
        assert sorted(scaler.managed) == ["auto-1", "auto-2"]
        policy.config = dataclasses.replace(policy.config, min_instances=1, max_instances=1)
        wait_for("a scale-down", lambda: scaler.step() or scaler.retiring or scaler.retired,
                 timeout_s=300)
        assert scaler.decisions[-1]["action"] == "scale_down"
        retired = scaler.decisions[-1]["retire"]
        assert len(retired) == 1 and len(scaler.managed) == 1
        backend.retirements[retired[0]].join(timeout=600)
        event = next(e for e in backend.events if e["instance_id"] == retired[0])
        assert event["how"] == "drained" and event["exit_code"] == 0, event
        assert table()[retired[0]]["state"] == "left"
    finally:
        scaler.shutdown()
        client.close()
    # shutdown retired the last one; every instance's placement group is gone
    assert not scaler.managed and backend.events[-1]["exit_code"] == 0
    groups = ray.util.placement_group_table()
    ours = [g for g in groups.values() if str(g.get("name", "")).startswith("autoscale:")]
    assert len(ours) == 3 and all(g["state"] == "REMOVED" for g in ours), ours
    assert wait_for("the GPUs back", lambda: ray.available_resources().get("GPU") == 4,
                    timeout_s=300)
