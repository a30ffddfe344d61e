"""Benchmark of weight-file uploads to a real dataflow service: sliced body vs one bytes body.

    python tests/benchmarks/bench_weight_upload.py --json                # 600 MiB, 2 repeats
    python tests/benchmarks/bench_weight_upload.py --json --mib 200      # quicker

Why: ``DataflowClient.upload_weight_file`` once handed httpx a single ``bytes`` body; httpcore's
sync writer re-slices the unsent rest of such a body after every socket send, copying it again
each time, so the upload time grew with the square of the file size (the GPU check measured a
1.19 GB full version at 68.9 s). The client now sends bodies above ``UPLOAD_CHUNK_BYTES`` as
memoryview slices with an explicit Content-Length. This script uploads the same random file to a
real ``astralight dataflow serve`` on 127.0.0.1 both ways in one process -- ``sliced`` (the
client as shipped) and ``single_body`` (the baseline: the threshold raised above the file size,
so it goes as one bytes body) -- each to a new version, best of ``--repeats``, and prints MB/s
per way and their ratio. The service receives, hashes (sha256) and fsyncs every upload in both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=600, help="file size in MiB")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    if args.mib < 2 or args.repeats < 1:
        p.error("--mib must be >= 2 and --repeats >= 1")

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import check  # its start_dataflow: `astralight dataflow serve` on a free loopback port

    from astralight.dataflow import client as client_mod
    from astralight.dataflow.client import DataflowClient

    work = Path(tempfile.mkdtemp(prefix="bench-upload-"))
    url, proc = check.start_dataflow(work)
    data = os.urandom(1 << 20) * args.mib  # 1 MiB of random bytes, repeated
    result: dict = {"bytes": len(data), "repeats": args.repeats}
    version = 0
    try:
        with DataflowClient(url, timeout=3600.0) as c:
            for way, threshold in (("sliced", client_mod.UPLOAD_CHUNK_BYTES),
                                   ("single_body", len(data) + 1)):
                saved = client_mod.UPLOAD_CHUNK_BYTES
                client_mod.UPLOAD_CHUNK_BYTES = threshold
                try:
                    times = []
                    for _ in range(args.repeats):
                        version += 1
                        t = time.perf_counter()
                        c.upload_weight_file("policy", version, "model.safetensors", data)
                        times.append(time.perf_counter() - t)
                        print(f"[bench-upload] {way}: {times[-1]:.2f} s", file=sys.stderr,
                              flush=True)
                finally:
                    client_mod.UPLOAD_CHUNK_BYTES = saved
                best = min(times)
                result[way] = {"seconds": round(best, 3), "mb_per_s": round(len(data) / best / 1e6, 1)}
        result["speedup"] = round(result["single_body"]["seconds"] / result["sliced"]["seconds"], 2)
    finally:
        check.stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for way in ("sliced", "single_body"):
            print(f"{way:12s} {result[way]['seconds']:8.2f} s {result[way]['mb_per_s']:8.1f} MB/s")
        print(f"speedup {result['speedup']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
