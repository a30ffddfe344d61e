"""Benchmark of the bf16 bit-diff delta codec: compression ratio and throughput per sparsity.

    python tests/benchmarks/bench_delta_codec.py --json                 # 800M elements, 3 sparsities
    python tests/benchmarks/bench_delta_codec.py --json --elements 2e7  # quick run
    python tests/benchmarks/bench_delta_codec.py --json --levels -1 1 3 9 --elements 1e8  # level trade-off
    python tests/benchmarks/bench_delta_codec.py --json --toy-run runs/toy-20250101-120000  # real versions

``--toy-run RUN_DIR`` measures the codec on *real consecutive versions* instead: it reads the
weight store a toy run left (``RUN_DIR/dataflow``, or a dataflow ``state_dir``: manifests from
``dataflow.db``, files from ``weights/``), rebuilds every stored version by applying the published
full and delta artifacts in order with ``WeightState`` (every checksum verified), and for each
pair of consecutive versions ``v-1 -> v`` prints the same keys (``sparsity`` is the measured
fraction of bit-identical bf16 elements), then one ``"summary": true`` object with medians. The
toy model has ~0.4M elements in 25 tensors, so its GB/s figures are per-call overhead, not codec
throughput; its sparsity and ratio are what the toy recipe's lr (5e-4) does to bf16 weights.

Data: a model-shaped state (a 151936x4096 embedding, then Qwen3-8B-like layers: 4096x4096 q/o,
1024x4096 k/v, 12288x4096 gate/up, 4096x12288 down, 4096 norms), truncated to ``--elements``.
Weights are fp32 masters ~ N(0, 0.02) (norms ~ 1) cast to bf16 with round-to-nearest-even.
The update (``--mode``):

* ``adam``: an lr-scaled Adam-like step on the fp32 master (``w + lr * N(0,1)``) cast to bf16
  again, lr calibrated so the fraction of changed bf16 patterns is ``1 - sparsity``. Most
  changes are +-1 ulp, and small weights (finer ulp) change more often: what lr 1e-6 RL
  updates look like (AstraFlow, Fig. 17).
* ``ulp``: each element changes with probability ``1 - sparsity`` by exactly +-1 ulp.
* ``random``: same positions, new values drawn afresh (worst case for the value stream).

Figures: ``encode_gbps``/``apply_gbps`` are GB of bf16 weights per second through
``encode_delta``/``apply_delta`` (one process, best of ``--repeats``; medians also given).
``*_with_checksums_gbps`` add the SHA-256 work the manifest needs (hashing changed tensors on
encode, verifying them after apply). ``*_cpu_gbps`` divide by the process's CPU seconds instead
of wall seconds: with ``--threads 0`` that is the single-core rate, robust to other processes on
shared cores (it still pays for their cache and memory-bandwidth pressure). Machine load is
reported too.
Peak memory stays ~2x the state (old + new bits) plus per-tensor temporaries.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
import zstandard

from astralight.weights.artifacts import tensor_table
from astralight.weights.delta import DEFAULT_LEVEL, apply_delta, changed_indices, encode_delta, encode_gaps

GEN_CHUNK = 1 << 24
LAYER = [
    ("self_attn.q_proj.weight", (4096, 4096), 0.02),
    ("self_attn.k_proj.weight", (1024, 4096), 0.02),
    ("self_attn.v_proj.weight", (1024, 4096), 0.02),
    ("self_attn.o_proj.weight", (4096, 4096), 0.02),
    ("mlp.gate_proj.weight", (12288, 4096), 0.02),
    ("mlp.up_proj.weight", (12288, 4096), 0.02),
    ("mlp.down_proj.weight", (4096, 12288), 0.02),
    ("input_layernorm.weight", (4096,), None),
    ("post_attention_layernorm.weight", (4096,), None),
]


def model_shapes(elements: int) -> list[tuple[str, tuple[int, ...], float | None]]:
    """Tensor names/shapes/std of a model-like state with exactly ``elements`` elements."""
    out, total = [], 0
    specs = [("model.embed_tokens.weight", (151936, 4096), 0.02)]
    layer = 0
    while total < elements:
        if not specs:
            specs = [(f"model.layers.{layer}.{n}", s, std) for n, s, std in LAYER]
            layer += 1
        name, shape, std = specs.pop(0)
        n = int(np.prod(shape))
        if total + n > elements:
            rows = max(1, (elements - total) // int(np.prod(shape[1:]))) if len(shape) > 1 else elements - total
            shape = (rows, *shape[1:]) if len(shape) > 1 else (rows,)
            n = int(np.prod(shape))
        out.append((name, shape, std))
        total += n
    return out


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _master(gen: torch.Generator, n: int, std: float | None) -> torch.Tensor:
    w = torch.randn(n, generator=gen)
    return w.mul_(0.02).add_(1.0) if std is None else w.mul_(std)


def calibrate_lr(target_changed: float, seed: int) -> float:
    """lr of ``w + lr * N(0,1)`` that changes ``target_changed`` of bf16 patterns of N(0, 0.02) weights."""
    gen = torch.Generator().manual_seed(seed + 999)
    w = _master(gen, 1 << 22, 0.02)
    step = torch.randn(w.numel(), generator=gen)
    old = _bits(w)
    lr = 1e-6
    for _ in range(30):
        frac = float(np.mean(old != _bits(w + lr * step)))
        if abs(frac - target_changed) < 0.002 * target_changed:
            break
        lr *= (target_changed / max(frac, 1e-9)) ** 0.8
    return lr


def make_pair(shapes, mode: str, sparsity: float, seed: int, lr: float):
    """(old bits, new bits) per tensor, generated in chunks so fp32 temporaries stay small."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, shape, std in shapes:
        n = int(np.prod(shape))
        a = np.empty(n, dtype=np.uint16)
        b = np.empty(n, dtype=np.uint16)
        for s in range(0, n, GEN_CHUNK):
            m = min(GEN_CHUNK, n - s)
            w = _master(gen, m, std)
            a[s : s + m] = _bits(w)
            if mode == "adam":
                b[s : s + m] = _bits(w.add_(torch.randn(m, generator=gen).mul_(lr)))
                continue
            b[s : s + m] = a[s : s + m]
            hit = np.flatnonzero(rng.random(m, dtype=np.float32) < (1.0 - sparsity))
            if mode == "ulp":
                b[s + hit] += np.where(rng.random(hit.size) < 0.5, 1, -1).astype(np.uint16)  # wraps: fine
            else:
                b[s + hit] = _bits(_master(gen, hit.size, std))
        old[name], new[name] = a.reshape(shape), b.reshape(shape)
    return old, new


def _cpu() -> float:
    """CPU seconds (user + system) of this process: with one thread, the work done, whatever
    other processes on shared cores take from the wall clock."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def layout_compare(old, new, level: int) -> dict:
    """Bytes of the same delta with interleaved (gaps, then values) vs byte-plane layout."""
    inter = planes = 0
    for name in new:
        idx = changed_indices(old[name], new[name])
        if not idx.size:
            continue
        gaps, vals = encode_gaps(idx), new[name].reshape(-1)[idx]
        c = zstandard.ZstdCompressor(level=level)
        inter += len(c.compress(gaps.tobytes() + vals.tobytes()))
        planes += len(c.compress(gaps.view(np.uint8).reshape(-1, gaps.itemsize).T.tobytes()
                                 + vals.view(np.uint8).reshape(-1, 2).T.tobytes()))
    return {"interleaved_bytes": inter, "planes_bytes": planes}


def run(args) -> list[dict]:
    shapes = model_shapes(int(args.elements))
    results = []
    for mode in args.mode:
        for sparsity in args.sparsity:
            lr = calibrate_lr(1.0 - sparsity, args.seed) if mode == "adam" else 0.0
            t = time.perf_counter()
            old, new = make_pair(shapes, mode, sparsity, args.seed, lr)
            gen_s = time.perf_counter() - t
            elements = sum(a.size for a in new.values())
            full_bytes = 2 * elements
            for level in args.levels:
                load0 = os.getloadavg()
                enc, hsh, app, ver, enc_cpu, app_cpu = [], [], [], [], [], []
                blob = stats = None
                for _ in range(args.repeats):
                    t, c = time.perf_counter(), _cpu()
                    blob, stats = encode_delta(old, new, level=level, threads=args.threads)
                    enc.append(time.perf_counter() - t)
                    enc_cpu.append(_cpu() - c)
                    t = time.perf_counter()
                    tensor_table(new, previous={n: {"sha256": ""} for n in new}, changed=stats.changed)
                    hsh.append(time.perf_counter() - t)
                # Apply onto ``old`` itself (memory: two states, not three), restoring it from a
                # reverse delta between repeats (not timed).
                rev, _ = encode_delta(new, old, level=-1)
                names = stats.changed
                for r in range(args.repeats):
                    t, c = time.perf_counter(), _cpu()
                    apply_delta(old, blob, threads=args.threads)
                    app.append(time.perf_counter() - t)
                    app_cpu.append(_cpu() - c)
                    t = time.perf_counter()
                    tensor_table({n: old[n] for n in names})
                    ver.append(time.perf_counter() - t)
                    if not all(np.array_equal(old[n], new[n]) for n in new):
                        raise SystemExit("apply_delta did not reproduce the new state bit-exactly")
                    apply_delta(old, rev)
                del rev
                res = {
                    "sparsity": sparsity,
                    "mode": mode,
                    "level": level,
                    "measured_sparsity": round(stats.sparsity, 6),
                    "elements": elements,
                    "tensors": len(new),
                    "changed_tensors": len(stats.changed),
                    "full_bytes": full_bytes,
                    "delta_bytes": stats.delta_bytes,
                    "compression_ratio": round(full_bytes / stats.delta_bytes, 2),
                    "bytes_per_change": round(stats.delta_bytes / max(stats.changed_elements, 1), 3),
                    "raw_index_value_ratio": round(full_bytes / max(6 * stats.changed_elements, 1), 2),
                    "gap_dtypes": stats.gap_dtypes,
                    "encode_gbps": round(full_bytes / min(enc) / 1e9, 3),
                    "apply_gbps": round(full_bytes / min(app) / 1e9, 3),
                    "encode_gbps_median": round(full_bytes / statistics.median(enc) / 1e9, 3),
                    "apply_gbps_median": round(full_bytes / statistics.median(app) / 1e9, 3),
                    "encode_with_checksums_gbps": round(full_bytes / min(e + h for e, h in zip(enc, hsh)) / 1e9, 3),
                    "apply_with_checksums_gbps": round(full_bytes / min(a + v for a, v in zip(app, ver)) / 1e9, 3),
                    "encode_cpu_gbps": round(full_bytes / min(enc_cpu) / 1e9, 3),
                    "apply_cpu_gbps": round(full_bytes / min(app_cpu) / 1e9, 3),
                    "encode_s": [round(x, 4) for x in enc],
                    "apply_s": [round(x, 4) for x in app],
                    "diff_s": round(stats.diff_s, 4),
                    "compress_s": round(stats.compress_s, 4),
                    "threads": args.threads,
                    "repeats": args.repeats,
                    "generate_s": round(gen_s, 1),
                    "loadavg_before": [round(x, 2) for x in load0],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                }
                if args.compare_layouts:
                    res.update(layout_compare(old, new, level))
                results.append(res)
                if args.json:
                    print(json.dumps(res), flush=True)
                else:
                    print(f"{mode:6s} s={sparsity:<6} L{level:<3} ratio {res['compression_ratio']:7.1f} "
                          f"({res['bytes_per_change']:.2f} B/change) encode {res['encode_gbps']:.2f} GB/s "
                          f"apply {res['apply_gbps']:.2f} GB/s  (+sha256: {res['encode_with_checksums_gbps']:.2f} / "
                          f"{res['apply_with_checksums_gbps']:.2f})  load {res['loadavg_before'][0]}", flush=True)
            del old, new
    return results


def load_run_versions(run_dir: str) -> dict[str, dict[int, dict[str, np.ndarray]]]:
    """Every version a toy run's dataflow stored, rebuilt and verified: {model_id: {v: bits}}.

    A version whose chain is broken (garbage-collected base) is skipped until the next full one.
    """
    import sqlite3
    from pathlib import Path

    from astralight.protocol import decode
    from astralight.weights import WeightState

    root = Path(run_dir)
    state_dir = root / "dataflow" if (root / "dataflow" / "dataflow.db").exists() else root
    db = state_dir / "dataflow.db"
    if not db.exists():
        raise SystemExit(f"--toy-run: no dataflow.db under {run_dir} (expected RUN_DIR/dataflow/ "
                         "or a dataflow state_dir)")
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = conn.execute("SELECT model_id, version, manifest FROM versions ORDER BY model_id, version")
    out: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    states: dict[str, WeightState] = {}
    for mid, version, blob in rows.fetchall():
        m = decode(bytes(blob))
        ws = states.setdefault(mid, WeightState())
        if ws.needs_full(m):
            continue
        files = {n: state_dir / "weights" / mid / str(version) / n for n in m.files}
        try:
            ws.apply(m, files)
        except Exception as exc:  # a missing or corrupt file: resume at the next full version
            print(f"# {mid} v{version}: {exc}", file=sys.stderr)
            states[mid] = WeightState()
            continue
        out.setdefault(mid, {})[version] = {n: a.copy() for n, a in ws.state.items()}
    conn.close()
    return out


def run_toy(args) -> list[dict]:
    """Codec figures on consecutive versions of a toy run (see the module docstring)."""
    results = []
    for mid, versions in load_run_versions(args.toy_run).items():
        pairs = [(v - 1, v) for v in sorted(versions) if v - 1 in versions]
        per = []
        for a, b in pairs:
            old, new = versions[a], versions[b]
            elements = sum(x.size for x in new.values())
            full_bytes = 2 * elements
            enc, app = [], []
            for _ in range(args.repeats):
                t = time.perf_counter()
                blob, stats = encode_delta(old, new, level=args.levels[0], threads=args.threads)
                enc.append(time.perf_counter() - t)
                work = {n: x.copy() for n, x in old.items()}
                t = time.perf_counter()
                apply_delta(work, blob, threads=args.threads)
                app.append(time.perf_counter() - t)
            if not all(np.array_equal(work[n], new[n]) for n in new):
                raise SystemExit(f"apply_delta did not reproduce {mid} v{b} bit-exactly")
            res = {"source": "toy-run", "model_id": mid, "base_version": a, "version": b,
                   "sparsity": round(stats.sparsity, 6), "elements": elements,
                   "tensors": len(new), "changed_tensors": len(stats.changed),
                   "full_bytes": full_bytes, "delta_bytes": stats.delta_bytes,
                   "compression_ratio": round(full_bytes / stats.delta_bytes, 3),
                   "encode_gbps": round(full_bytes / min(enc) / 1e9, 3),
                   "apply_gbps": round(full_bytes / min(app) / 1e9, 3), "level": args.levels[0]}
            per.append(res)
            if args.json:
                print(json.dumps(res), flush=True)
        if per:
            summary = {"source": "toy-run", "summary": True, "model_id": mid, "pairs": len(per),
                       "versions": [per[0]["base_version"], per[-1]["version"]],
                       "elements": per[0]["elements"], "full_bytes": per[0]["full_bytes"],
                       "level": args.levels[0]}
            for key in ("sparsity", "delta_bytes", "compression_ratio", "encode_gbps", "apply_gbps"):
                vals = [r[key] for r in per]
                summary[key] = statistics.median(vals)
                summary[f"{key}_min"], summary[f"{key}_max"] = min(vals), max(vals)
            results.append(summary)
            if args.json:
                print(json.dumps(summary), flush=True)
            else:
                print(f"{mid}: {len(per)} consecutive pairs v{summary['versions'][0]}..v"
                      f"{summary['versions'][1]}: sparsity median {summary['sparsity']:.4f} "
                      f"({summary['sparsity_min']:.4f}-{summary['sparsity_max']:.4f}), ratio median "
                      f"{summary['compression_ratio']:.2f}", flush=True)
    if not results:
        raise SystemExit(f"--toy-run: no two consecutive stored versions under {args.toy_run}")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=float, default=8e8, help="bf16 elements in the state (default 8e8)")
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.97, 0.989, 0.995])
    p.add_argument("--mode", nargs="+", default=["adam", "ulp"], choices=["adam", "ulp", "random"])
    p.add_argument("--levels", type=int, nargs="+", default=[DEFAULT_LEVEL], help="zstd levels to measure")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="tensor-level threads in encode/apply (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-layouts", action="store_true", help="also report interleaved vs byte-plane bytes")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--toy-run", metavar="RUN_DIR", default=None,
                   help="measure on consecutive versions stored by a toy run (RUN_DIR/dataflow)")
    args = p.parse_args(argv)
    if args.toy_run:
        run_toy(args)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
