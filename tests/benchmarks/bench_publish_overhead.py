"""Step-time overhead of the WeightPublisher on the toy trainer, in one process.

    python tests/benchmarks/bench_publish_overhead.py --json
    python tests/benchmarks/bench_publish_overhead.py --json --store memory --repeats 2 --steps 20
    python tests/benchmarks/bench_publish_overhead.py --json --worker thread   # the GIL-sharing worker

What runs: ``M2POPolicy`` (the toy recipe's settings: M2PO, lr 5e-4, temperature 1.0) on the
tiny Qwen3 toy model (built locally, or ``--model-dir`` e.g. a run's warm-started
``models/init``), in a real Lightning ``Trainer.fit`` on CPU, fed by the real
``RolloutDataModule`` whose client is a *fake datamodule source*: a pool of toy-shaped batches
(256 samples = 32 arithmetic prompts x 8, prompt ``"37+45="``, completions of <= 6 tokens, exact-
match rewards, group-normalised advantages, behaviour log-probs of the initial model) built once
before timing, so batch supply costs nothing and both arms see identical work. Fits alternate
*without* and *with* ``WeightPublisher(every_n_steps=1, full_every=10)`` (the recipe publishes
every step), ``--repeats`` times each, every fit from the same initial weights.

Where the publisher publishes (``--store``): ``dataflow`` (default) a real dataflow service
started on 127.0.0.1 with the publisher's default ``worker="process"`` (encode, HTTP upload and
publish in the encoder process; ``--worker thread`` runs them in a thread of the trainer
instead). The service and the encoder are other processes on the same cores, so on a busy
2-core machine their CPU still competes with the trainer: an upper bound. ``memory``: an
in-process client that keeps the files, with ``worker="thread"`` (the in-process cost of
encoding, checksums and the GIL it holds).

Step time: wall time between consecutive ``on_train_batch_end`` of a callback placed after the
publisher (so it includes the training-thread snapshot), first ``--warmup`` steps of each fit
dropped; ``step_s_*`` are medians over all kept steps of that arm, ``overhead_fraction =
step_s_with / step_s_without - 1``. ``--threads`` sets torch's intra-op threads (default 1, as
the toy recipe's ``OMP_NUM_THREADS=1`` trainer): the publisher's worker thread then has the
other core. Also printed: each version's kind, sparsity (fraction of bit-identical bf16
elements vs the previous published version), bytes and compression ratio, from the last fit.
Timings are wall clock on a shared machine: compare arms of one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

STEPS_PER_FIT = 30


class MemoryStore:
    """In-process stand-in for the dataflow's weight face: keeps uploads, checks publications."""

    def __init__(self):
        self.files: dict[tuple[int, str], bytes] = {}
        self.manifests = []
        self.version = 0

    def current_version(self, model_id):
        return self.version

    def upload_weight_file(self, model_id, version, name, data):
        self.files[(version, name)] = bytes(data)

    def publish(self, manifest):
        missing = [n for n in manifest.files if (manifest.version, n) not in self.files]
        if missing or manifest.version <= self.version:
            raise ValueError(f"bad publication {manifest.version}: missing {missing}")
        self.manifests.append(manifest)
        self.version = manifest.version
        return {"version": manifest.version}

    def close(self):
        pass


class PooledBatches:
    """The datamodule's client: serves pre-built toy batches round-robin; acks are no-ops."""

    def __init__(self, pool):
        self.pool = pool
        self.served = 0

    def pull_batch(self, model_id, size, timeout_s=30.0, trainer_id=None):
        from astralight.protocol import Batch

        b = self.pool[self.served % len(self.pool)]
        self.served += 1
        return Batch(batch_id=f"b{self.served}", model_id=b.model_id,
                     policy_version=b.policy_version, samples=b.samples)

    def ack(self, batch_id, wait_s=None, step_s=None, step=None):
        pass

    def close(self):
        pass


def toy_batches(model_dir: str, n_batches: int, prompts: int, group: int, seed: int):
    """Toy-shaped batches: arithmetic prompts, answer-or-noise completions, exact-match reward."""
    from transformers import AutoModelForCausalLM

    from astralight.protocol import Batch, Sample
    from astralight.rl.advantages import group_normalized_advantages
    from astralight.rl.logprobs import causal_lm_logprobs
    from astralight.tasks.arithmetic import ArithmeticSource
    from astralight.trainer.tinymodel import build_tokenizer

    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    source = ArithmeticSource(split="train", seed=seed, max_operand=49)
    rng = np.random.default_rng(seed)
    pool, k = [], 0
    for b in range(n_batches):
        samples = []
        for p in range(prompts):
            prompt = source.get(k)
            k += 1
            prompt_ids = [2] + tok.encode(prompt.prompt, add_special_tokens=False)
            answer = prompt.metadata["answer"]
            for i in range(group):
                text = answer if rng.random() < 0.3 else "".join(
                    str(d) for d in rng.integers(0, 10, int(rng.integers(1, 4))))
                gen = tok.encode(text, add_special_tokens=False)[:5] + [1]
                ids = np.array(prompt_ids + gen, dtype=np.int32)
                with torch.no_grad():
                    lp = causal_lm_logprobs(model, torch.from_numpy(ids).long()[None])[0].numpy()
                mask = np.zeros(len(ids), np.uint8)
                mask[len(prompt_ids):] = 1
                samples.append(Sample(
                    task_id=f"t{b}-{p}", sample_index=i, model_id="policy", token_ids=ids,
                    logprobs=(np.minimum(np.concatenate([[0.0], lp]), 0.0) * mask).astype(np.float32),
                    loss_mask=mask, versions=np.where(mask > 0, 0, -1).astype(np.int32),
                    reward=float(text == answer), prompt_len=len(prompt_ids),
                    metadata={"temperature": 1.0, "finish_reason": "stop"}))
        adv = group_normalized_advantages(torch.tensor([s.reward for s in samples]),
                                          [s.task_id for s in samples])
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a
        pool.append(Batch(batch_id=f"pool{b}", model_id="policy", policy_version=0, samples=samples))
    return pool


def start_dataflow(workdir: Path, model_ids: list[str]) -> tuple[subprocess.Popen, str]:
    """A real dataflow service on a free loopback port (weights GC on, no grace period)."""
    import socket

    import yaml

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = {"host": "127.0.0.1", "port": port, "state_dir": str(workdir / "dataflow"),
           "log_level": "WARNING", "weights_keep_s": 0, "model_ids": model_ids}
    path = workdir / "dataflow.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(workdir / "dataflow.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "astralight.dataflow.service", "--config",
                             str(path)], stdout=log, stderr=subprocess.STDOUT)
    from astralight.dataflow.client import DataflowClient

    client = DataflowClient(f"http://127.0.0.1:{port}", retry_s=60)
    client.info()  # waits for the service
    client.close()
    return proc, f"http://127.0.0.1:{port}"


def one_fit(args, model_dir, pool, publisher, workdir, tag):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from astralight.datamodules import RolloutDataModule
    from astralight.policy import M2POPolicy

    class StepTimer(pl.Callback):
        def __init__(self):
            self.ends = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    timer = StepTimer()
    dm = RolloutDataModule("http://127.0.0.1:9", model_id="policy", batch_size=len(pool[0].samples))
    dm.client = PooledBatches(pool)
    policy = M2POPolicy(model_dir, model_id="policy", loss="m2po", lr=args.lr, temperature=1.0,
                        seed=args.seed)
    callbacks = ([publisher] if publisher is not None else []) + [timer]
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, precision=32,
                         logger=TensorBoardLogger(str(workdir / "tb"), name=tag),
                         log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(policy, datamodule=dm)
    steps = np.diff(np.array(timer.ends))
    return steps[max(0, args.warmup - 1):]


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    from astralight.callbacks import WeightPublisher
    from astralight.trainer.tinymodel import build_tiny_model_folder

    workdir = Path(tempfile.mkdtemp(prefix="bench_publish_"))
    model_dir = args.model_dir or str(build_tiny_model_folder(workdir / "model"))
    t = time.perf_counter()
    pool = toy_batches(model_dir, args.pool, args.prompts, args.group, args.seed)
    build_s = time.perf_counter() - t
    proc = url = None
    if args.store == "dataflow":
        proc, url = start_dataflow(workdir, [f"policy{r}" for r in range(args.repeats)])
    try:
        without, with_, runs, publisher = [], [], [], None
        for r in range(args.repeats):
            s = one_fit(args, model_dir, pool, None, workdir, f"without{r}")
            without.extend(s)
            runs.append({"arm": "without", "median_step_s": float(np.median(s))})
            # one model_id per repeat: every fit starts again at version 1
            worker = "thread" if args.store == "memory" else args.worker
            publisher = WeightPublisher(dataflow_url=url, model_id=f"policy{r}", every_n_steps=1,
                                        full_every=args.full_every, worker_nice=args.nice,
                                        worker=worker)
            if args.store == "memory":
                publisher.client = MemoryStore()
            s = one_fit(args, model_dir, pool, publisher, workdir, f"with{r}")
            with_.extend(s)
            runs.append({"arm": "with", "median_step_s": float(np.median(s)),
                         "published": len(publisher.history), "replaced": publisher.replaced,
                         "errors": publisher.errors})
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    hist = list(publisher.history)
    deltas = [h for h in hist if h["kind"] == 0.0]
    step_without, step_with = float(np.median(without)), float(np.median(with_))
    return {
        "step_s_without": round(step_without, 5),
        "step_s_with": round(step_with, 5),
        "overhead_fraction": round(step_with / step_without - 1.0, 4),
        "step_s_without_mean": round(float(np.mean(without)), 5),
        "step_s_with_mean": round(float(np.mean(with_)), 5),
        "step_s_without_p90": round(float(np.percentile(without, 90)), 5),
        "step_s_with_p90": round(float(np.percentile(with_, 90)), 5),
        "steps_per_arm": len(without),
        "runs": runs,
        "store": args.store,
        "threads": args.threads,
        "worker_nice": args.nice,
        "worker": "thread" if args.store == "memory" else args.worker,
        "lr": args.lr,
        "batch_samples": args.prompts * args.group,
        "full_every": args.full_every,
        "published_elements": hist[-1]["full_bytes"] // 2,
        "snapshot_s_median": round(statistics.median(h["snapshot_s"] for h in hist), 6),
        "encode_s_median": round(statistics.median(h["encode_s"] for h in hist), 5),
        "latency_s_median": round(statistics.median(h["latency_s"] for h in hist), 5),
        "delta_sparsity_median": round(statistics.median(h["sparsity"] for h in deltas), 5)
        if deltas else None,
        "delta_compression_ratio_median": round(statistics.median(
            h["compression_ratio"] for h in deltas), 3) if deltas else None,
        "versions": [{"version": h["version"], "kind": "full" if h["kind"] else "delta",
                      "sparsity": round(h["sparsity"], 5) if "sparsity" in h else None,
                      "bytes": h["bytes"], "full_bytes": h["full_bytes"],
                      "compression_ratio": round(h["compression_ratio"], 3)} for h in hist],
        "batch_pool_build_s": round(build_s, 2),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", choices=["dataflow", "memory"], default="dataflow")
    p.add_argument("--steps", type=int, default=STEPS_PER_FIT, help="optimizer steps per fit")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of each fit")
    p.add_argument("--repeats", type=int, default=3, help="fits per arm (alternating)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--lr", type=float, default=5e-4, help="the toy recipe's lr")
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--nice", type=int, default=19, help="WeightPublisher(worker_nice=...)")
    p.add_argument("--worker", choices=["process", "thread"], default="process",
                   help="WeightPublisher(worker=...) with --store dataflow (memory: thread)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--pool", type=int, default=4, help="distinct batches served round-robin")
    p.add_argument("--model-dir", default=None, help="HF folder (default: a fresh tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"step without {res['step_s_without']:.4f} s, with {res['step_s_with']:.4f} s: "
              f"overhead {100 * res['overhead_fraction']:.1f}%  (deltas: sparsity "
              f"{res['delta_sparsity_median']}, ratio {res['delta_compression_ratio_median']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
