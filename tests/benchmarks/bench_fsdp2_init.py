"""Benchmark of FSDP2 start-up: host memory and time per rank when every rank reads the model
versus when only rank zero reads it and broadcasts the shards.

    python tests/benchmarks/bench_fsdp2_init.py --json                  # 2 ranks, ~300M params
    python tests/benchmarks/bench_fsdp2_init.py --json --layers 4       # quicker

Why: before, every FSDP2 rank loaded the full float32 model from disk (a 14B policy on 8 GPUs of
one machine: 8 x 56 GB of host memory) and only then sharded it. Now rank zero reads the weights
and the other ranks build the model on the meta device and receive their shards
(:func:`astralight.trainer.fsdp2.shard_from_rank0`). This script builds a random Qwen3 model folder of
the chosen shape, then runs ``--ranks`` gloo ranks on CPU twice in the same invocation:
``every_rank_reads`` (the baseline: :func:`astralight.policy.load_causal_lm` on every rank, then
:func:`astralight.trainer.fsdp2.shard`) and ``rank0_broadcast`` (the shipped path: ``load_causal_lm`` on
rank zero, ``empty_causal_lm`` elsewhere, then ``shard_from_rank0``). Each rank reports its peak
resident memory above what it held before building the model, and the build + shard seconds;
both ways' sharded weights are compared (sha256 of every local shard) so the figures are of two
ways to the same result. Prints the per-rank figures and the ratio of the non-zero ranks' peak
memory.

Read the figures as a CPU worst case: here the shards and the broadcast buffers are host memory
too, and with two ranks a rank's shards are half the model. On GPUs a rank other than zero keeps
its shards and the broadcast buffer on its GPU, so its host memory holds none of the weights
(before: the whole float32 model), and the saving grows with the number of ranks. The peak of a
rank is its resident high-water mark (VmHWM) above what it held before building the model;
"held after" is what it still holds once sharded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("every_rank_reads", "rank0_broadcast")


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    """This process's resident high-water mark (VmHWM). Not ``ru_maxrss``: Linux carries that
    over from the parent across fork + exec, so it would report the parent's model build."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_rank(way: str, model_dir: str, out: str) -> None:
    """One rank (RANK / WORLD_SIZE / MASTER_* from the environment)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from astralight.trainer import fsdp2
    from astralight.policy import empty_causal_lm, load_causal_lm

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    dist.barrier()
    base_mb, t0 = _rss_now_mb(), time.perf_counter()
    if way == "every_rank_reads":
        model = load_causal_lm(model_dir)
        fsdp2.shard(model, mesh, "32-true")
    else:
        build = load_causal_lm if fsdp2.reads_weights(mesh) else empty_causal_lm
        model = build(model_dir)
        fsdp2.shard_from_rank0(model, mesh, "32-true", torch.device("cpu"))
    seconds = time.perf_counter() - t0
    peak_above_start = max(0.0, _peak_mb() - base_mb)  # before hashing (tobytes copies)
    held_after = max(0.0, _rss_now_mb() - base_mb)
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.to_local().detach().contiguous().numpy().tobytes())
    Path(out, f"{way}.rank{rank}.json").write_text(json.dumps({
        "rank": rank, "seconds": round(seconds, 2), "peak_above_start_mb":
        round(peak_above_start, 1), "held_after_mb": round(held_after, 1),
        "shards_sha256": digest.hexdigest()}))
    dist.barrier()
    dist.destroy_process_group()


def _build_model(path: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from astralight.trainer.tinymodel import build_tokenizer

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), head_dim=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.hidden % 256 or args.layers < 1:
        p.error("--ranks must be >= 2, --hidden a multiple of 256, --layers >= 1")

    with tempfile.TemporaryDirectory(prefix="bench_fsdp2_init_") as tmp:
        model_dir = Path(tmp) / "model"
        params = _build_model(model_dir, args.hidden, args.layers, args.vocab)
        print(f"model: {params / 1e6:.0f}M params, {params * 4 / 2**30:.2f} GiB in float32",
              file=sys.stderr)
        results: dict[str, list[dict]] = {}
        for i, way in enumerate(WAYS):
            print(f"[{i + 1}/{len(WAYS)}] {way}: {args.ranks} gloo ranks ...", file=sys.stderr)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + i),
                   "WORLD_SIZE": str(args.ranks)}
            procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", way, str(model_dir),
                                       tmp], env={**env, "RANK": str(r)}, cwd=ROOT)
                     for r in range(args.ranks)]
            if any(proc.wait(timeout=900) != 0 for proc in procs):
                print(f"{way}: a rank failed", file=sys.stderr)
                return 1
            results[way] = [json.loads(Path(tmp, f"{way}.rank{r}.json").read_text())
                            for r in range(args.ranks)]
    same = all(a["shards_sha256"] == b["shards_sha256"]
               for a, b in zip(results[WAYS[0]], results[WAYS[1]]))
    others = {w: max(r["peak_above_start_mb"] for r in rs[1:]) for w, rs in results.items()}
    summary = {
        "params_m": round(params / 1e6, 1), "ranks": args.ranks, "same_shards": same,
        "per_rank": {w: [{k: r[k] for k in ("rank", "seconds", "peak_above_start_mb",
                                            "held_after_mb")}
                         for r in rs] for w, rs in results.items()},
        "nonzero_rank_peak_mb": others,
        "nonzero_rank_peak_ratio": round(others[WAYS[0]] / max(others[WAYS[1]], 1.0), 2),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for way in WAYS:
            for r in summary["per_rank"][way]:
                print(f"{way:18s} rank {r['rank']}: {r['seconds']:6.2f} s, peak "
                      f"+{r['peak_above_start_mb']:.0f} MB, held after "
                      f"+{r['held_after_mb']:.0f} MB")
        print(f"ranks > 0 peak memory: {others[WAYS[0]]:.0f} MB -> {others[WAYS[1]]:.0f} MB "
              f"({summary['nonzero_rank_peak_ratio']}x); same shards: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        sys.path.insert(0, str(ROOT))
        run_rank(*sys.argv[2:5])
    else:
        sys.exit(main())
