"""Benchmark: push and pull throughput of a real dataflow service process (prints figures).

    python tests/benchmarks/bench_dataflow.py [--tasks 200] [--group 8] [--tokens 256] [--batch 64]
    python tests/benchmarks/bench_dataflow.py --ingest [--clients 4] [--tasks 400]
        [--per-request 16] [--repeat 3]

The first form is one client pushing one task per request, then pulling it all back.

``--ingest`` measures what several RaaS pushing at once get, in one invocation, with one fresh
service per arm (same machine, same tasks, same samples):

* ``baseline``: one task per ``POST /v1/push``, ``group_commit: false`` (every commit fsyncs the
  WAL under the service lock: the service as it was before group commit);
* ``single_group_commit``: one task per request, ``group_commit: true``;
* ``batched``: ``push_many`` with ``--per-request`` tasks per request, ``group_commit: true``.

The arms run interleaved ``--repeat`` times (default 3); per arm the median run is reported.
It prints one JSON object (with ``fsync_ms``, what one fsync costs on this disk): per arm
``pushes_per_s`` (tasks made durable per second) and
``samples_per_s`` (with every run's pushes/s), the service process's CPU time per push, the
service's ``commits`` and ``fsyncs`` (``durability`` in ``/v1/stats``; fewer fsyncs than commits
means commits shared one), ``ratio_pushes_per_s`` (batched over baseline; the other ratios beside
it) and the machine load before and after (``os.getloadavg()``) -- on a shared machine the
figures are only comparable within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from astralight.dataflow.client import DataflowClient
from astralight.launch.proc import stop_process
from astralight.protocol import Sample

#: the ingest arms: name -> (tasks per request, group_commit setting; None: do not set it)
ARMS = {"baseline": (1, False), "single_group_commit": (1, True), "batched": (None, True)}


def start_service(tmp: str, config: dict) -> tuple[subprocess.Popen, str]:
    """A dataflow service process on 127.0.0.1 with ``config``; returns it and its URL."""
    cfg = Path(tmp) / "dataflow.yaml"
    cfg.write_text(yaml.safe_dump({"host": "127.0.0.1", "port": 0, "state_dir": f"{tmp}/state",
                                   "log_level": "WARNING", **config}))
    proc = subprocess.Popen([sys.executable, "-m", "astralight.dataflow.service", "--config",
                             str(cfg)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " on " not in line:
        proc.kill()
        raise RuntimeError(f"dataflow service did not start (said {line!r})")
    return proc, line.split(" on ", 1)[1].strip()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process used so far (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fsync_ms(folder: str, n: int = 50) -> float:
    """Mean latency of a 4 KiB write + fsync in ``folder``: what one commit's fsync costs on
    this disk (the most group commit can save per commit it shares)."""
    path = Path(folder) / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        return round(1000 * (time.perf_counter() - t0) / n, 3)
    finally:
        os.close(fd)
        path.unlink()


def make_group(rng: np.random.Generator, task_id: str, group: int, tokens: int) -> list[Sample]:
    """One task's samples: ``group`` samples of ``tokens`` generated tokens each."""
    return [Sample(task_id=task_id, sample_index=i, model_id="policy",
                   token_ids=rng.integers(0, 32000, tokens).astype(np.int32),
                   logprobs=-rng.random(tokens).astype(np.float32),
                   loss_mask=np.ones(tokens, np.uint8), versions=np.zeros(tokens, np.int32),
                   reward=float(rng.random())) for i in range(group)]


def simple(args) -> None:
    """One client: one push per task, then pull everything back (the original figures)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_service(tmp, {"group_size": args.group,
                                        "max_buffered_samples": args.tasks * args.group,
                                        "max_inflight_tasks": args.tasks})
        try:
            client = DataflowClient(url)
            iid = client.register(["policy"], capacity=args.tasks)["instance_id"]
            tasks = client.lease(iid, args.tasks)
            T = args.tokens
            rng = np.random.default_rng(0)
            groups = [make_group(rng, t.task_id, args.group, T) for t in tasks]
            t0 = time.perf_counter()
            for t, g in zip(tasks, groups):
                client.push(iid, t.task_id, g)
            push_s = time.perf_counter() - t0
            n = len(tasks) * args.group
            t0 = time.perf_counter()
            pulled = 0
            while (b := client.pull_batch("policy", args.batch, timeout_s=0)) is not None:
                client.ack(b.batch_id)
                pulled += len(b.samples)
            pull_s = time.perf_counter() - t0
            print(f"push: {len(tasks)} tasks x {args.group} samples x {T} tokens in {push_s:.2f} s "
                  f"= {len(tasks) / push_s:.0f} pushes/s, {n / push_s:.0f} samples/s (durable, fsync)")
            print(f"pull+ack: {pulled} samples in batches of {args.batch} in {pull_s:.2f} s = "
                  f"{pulled / pull_s:.0f} samples/s")
            client.close()
        finally:
            stop_process(proc)


def _client_pushes(url: str, iid: str, work: list[tuple[str, list[Sample]]], per_request: int,
                   start: threading.Barrier, out: dict) -> None:
    """One RaaS: push its tasks, ``per_request`` at a time (1: ``push``; more: ``push_many``),
    checking every reply; the counts go to ``out``."""
    client = DataflowClient(url)
    accepted = failed = 0
    start.wait()
    for i in range(0, len(work), per_request):
        chunk = work[i:i + per_request]
        if per_request == 1:
            replies = [client.push(iid, chunk[0][0], chunk[0][1])]
        else:
            replies = client.push_many(iid, chunk)
        for r in replies:
            if isinstance(r, dict) and not r["duplicate"]:
                accepted += r["accepted"]
            else:
                failed += 1
    out.update(accepted=accepted, failed=failed)
    client.close()


def ingest_arm(name: str, args) -> dict:
    """One arm of ``--ingest``: a fresh service, ``--clients`` RaaS pushing at once."""
    per_request, group_commit = ARMS[name]
    per_request = per_request or args.per_request
    config = {"group_size": args.group, "max_buffered_samples": args.tasks * args.group,
              "max_inflight_tasks": args.tasks, "lease_seconds": 3600}
    if group_commit is not None and not args.old_service:
        config["group_commit"] = group_commit
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_service(tmp, config)
        try:
            admin = DataflowClient(url)
            rng = np.random.default_rng(0)
            share = args.tasks // args.clients
            plans = []
            for c in range(args.clients):
                iid = admin.register(["policy"], capacity=share,
                                     instance_id=f"raas-{c}")["instance_id"]
                tasks = admin.lease(iid, share)
                assert len(tasks) == share, (len(tasks), share)
                plans.append((iid, [(t.task_id, make_group(rng, t.task_id, args.group, args.tokens))
                                    for t in tasks]))
            before = admin.stats().get("durability", {})
            cpu0 = cpu_seconds(proc.pid)
            start = threading.Barrier(args.clients + 1)
            outs = [{} for _ in plans]
            threads = [threading.Thread(target=_client_pushes,
                                        args=(url, iid, work, per_request, start, out))
                       for (iid, work), out in zip(plans, outs)]
            for t in threads:
                t.start()
            start.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            cpu = cpu_seconds(proc.pid) - cpu0
            stats = admin.stats()
            after = stats.get("durability", {})
            admin.close()
        finally:
            stop_process(proc)
    pushes = share * args.clients
    accepted = sum(o.get("accepted", 0) for o in outs)
    assert accepted == stats["models"]["policy"]["samples_accepted"] == pushes * args.group, \
        (accepted, outs)
    return {"tasks_per_request": per_request, "group_commit": group_commit,
            "requests": sum(-(-len(w) // per_request) for _, w in plans),
            "pushes": pushes, "samples": pushes * args.group, "elapsed_s": round(elapsed, 3),
            "pushes_per_s": round(pushes / elapsed, 1),
            "samples_per_s": round(pushes * args.group / elapsed, 1),
            "service_cpu_ms_per_push": round(1000 * cpu / pushes, 3),
            "commits": after.get("commits", 0) - before.get("commits", 0) if after else None,
            "fsyncs": after.get("fsyncs", 0) - before.get("fsyncs", 0) if after else None}


def median_run(runs: list[dict]) -> dict:
    """The run with the median ``pushes_per_s`` of an arm (the lower one of an even count),
    with every run's figure beside it."""
    runs = sorted(runs, key=lambda r: r["pushes_per_s"])
    return {**runs[(len(runs) - 1) // 2], "runs_pushes_per_s": [r["pushes_per_s"] for r in runs]}


def ingest(args) -> dict:
    """All ``--arms`` in this one invocation, interleaved ``--repeat`` times (the median run of
    each is reported), with the machine load around them."""
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in args.arms}
    for _ in range(args.repeat):
        for name in args.arms:
            runs[name].append(ingest_arm(name, args))
    arms = {name: median_run(r) for name, r in runs.items()}
    with tempfile.TemporaryDirectory() as tmp:
        probe = fsync_ms(tmp)
    out = {"load_before": [round(x, 2) for x in load_before],
           "load_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
           "fsync_ms": probe, "per_request": args.per_request,
           "clients": args.clients, "tasks": args.tasks, "group": args.group,
           "tokens": args.tokens, "repeat": args.repeat, "arms": arms}
    if "baseline" in arms:
        for name in arms:
            if name != "baseline":
                out[f"ratio_pushes_per_s_{name}"] = round(
                    arms[name]["pushes_per_s"] / arms["baseline"]["pushes_per_s"], 2)
        if "batched" in arms:
            out["ratio_pushes_per_s"] = out["ratio_pushes_per_s_batched"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=None, help="default: 200 (400 with --ingest)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ingest", action="store_true", help="compare the ingest arms, print JSON")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-request", type=int, default=16, help="tasks per push_many request")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--repeat", type=int, default=3, help="runs per arm, interleaved")
    ap.add_argument("--old-service", action="store_true",
                    help="do not set group_commit (a service from before it existed)")
    args = ap.parse_args(argv)
    if not args.ingest:
        args.tasks = args.tasks or 200
        simple(args)
        return
    args.tasks = args.tasks or 400
    print(json.dumps(ingest(args), indent=2))


if __name__ == "__main__":
    main()
