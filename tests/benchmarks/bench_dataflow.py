"""Benchmark: push and pull throughput of a real dataflow service process (prints figures).

    python tests/benchmarks/bench_dataflow.py [--tasks 200] [--group 8] [--tokens 256] [--batch 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from astralight.dataflow.client import DataflowClient
from astralight.protocol import Sample


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "dataflow.yaml"
        cfg.write_text(yaml.safe_dump({"port": 0, "state_dir": f"{tmp}/state",
                                       "group_size": args.group, "log_level": "WARNING",
                                       "max_buffered_samples": args.tasks * args.group,
                                       "max_inflight_tasks": args.tasks}))
        proc = subprocess.Popen([sys.executable, "-m", "astralight.dataflow.service", "--config",
                                 str(cfg)], stdout=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            url = line.split(" on ", 1)[1].strip()
            client = DataflowClient(url)
            iid = client.register(["policy"], capacity=args.tasks)["instance_id"]
            tasks = client.lease(iid, args.tasks)
            T = args.tokens
            rng = np.random.default_rng(0)

            def group(task):
                return [Sample(task_id=task.task_id, sample_index=i, model_id="policy",
                               token_ids=rng.integers(0, 32000, T).astype(np.int32),
                               logprobs=-rng.random(T).astype(np.float32),
                               loss_mask=np.ones(T, np.uint8), versions=np.zeros(T, np.int32),
                               reward=float(rng.random())) for i in range(args.group)]

            groups = [group(t) for t in tasks]
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
            proc.terminate()
            proc.wait(timeout=20)


if __name__ == "__main__":
    main()
