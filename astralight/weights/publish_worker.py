"""The WeightPublisher's encoder process: builds, uploads and publishes versions outside the trainer.

Why a process: encoding (numpy, zstd, sha256, safetensors) and the HTTP upload are partly
Python-level work. In a thread of the trainer they compete with the training loop for the GIL;
on the 2-core toy machine that cost the step ~5-7 % even with a free core, against ~2-3.5 % from
a process (``tests/benchmarks/bench_publish_overhead.py``; the rest is the snapshot copy and
the two processes sharing the machine).

Protocol (no pickle; one JSON object per line). The trainer starts
``python -m astralight.weights.publish_worker --url URL --model-id ID ...`` and writes commands
to its stdin; the process answers each ``job`` on its stdout (library prints are sent to
stderr so they cannot corrupt the answers):

* ``{"op": "layout", "elements": N, "tensors": [[name, offset, shape], ...]}``: how snapshots
  are packed into the two *slots*, shared-memory files of ``N`` bf16 elements that the trainer
  writes snapshots into (inherited as file descriptors ``--slot-fds``: anonymous ``memfd``
  files, so nothing is left behind if either process dies); a tensor is
  ``elements[offset:offset+numel]``.
* ``{"op": "job", "version", "step", "slot", "created", "full": bool, "metadata": {...}}``:
  build the version from that slot (full or delta onto the last published, see
  :class:`PublishBuilder`), upload its files, publish the manifest (with ``metadata`` merged).
  Answer ``{"ok": true, "version", "record": {...}}`` or ``{"ok": false, "version", "error"}``;
  after an error the next version is full. The trainer does not touch the slot until answered.
* ``{"op": "stop"}`` or end of input: exit.

The process is idle between jobs and runs at a lowered CPU priority (``--nice``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from astralight.weights.artifacts import Artifact, ArtifactBuilder
from astralight.weights.bf16 import state_to_bits


class PublishBuilder(ArtifactBuilder):
    """:class:`ArtifactBuilder` that also reports a full version's sparsity against the previous
    published state (a delta reports its own in ``manifest.metadata["sparsity"]``)."""

    def build(self, version, state, *, full=None):
        previous = self._published  # a full build replaces this dict; a delta updates it in place
        art = super().build(version, state, full=full)
        if art.manifest.kind == "full" and previous is not None:
            new = state_to_bits(state)
            if set(new) == set(previous) and all(new[n].shape == previous[n].shape for n in new):
                elements = sum(int(a.size) for a in new.values())
                changed = sum(int(np.count_nonzero(previous[n] != new[n])) for n in new)
                art.manifest.metadata["sparsity"] = 1.0 - changed / elements if elements else 1.0
        return art


def artifact_record(artifact: Artifact) -> dict:
    """Per-version figures: kind (1 full, 0 delta), sizes, compression ratio, sparsity."""
    m = artifact.manifest
    sent = sum(len(d) for d in artifact.files.values())
    full_bytes = 2 * sum(int(np.prod(t["shape"], dtype=np.int64)) for t in m.tensors.values())
    rec = {"kind": 1.0 if m.kind == "full" else 0.0, "base_version": m.base_version,
           "full_bytes": full_bytes, "bytes": sent,
           "compression_ratio": full_bytes / sent if sent else float("inf")}
    if m.kind == "delta":
        rec["delta_bytes"] = sent
    if "sparsity" in m.metadata:
        rec["sparsity"] = float(m.metadata["sparsity"])
    return rec


# ----------------------------------------------------------------------------- snapshot slots


def new_slot_fd(elements: int) -> int:
    """A shared-memory file of ``elements`` bf16 values, open read/write, with no name on disk
    (``memfd_create``; else an unlinked file in /dev/shm or the temp directory)."""
    size = max(2 * elements, 2)
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("astralight-weights-slot")
    else:  # pragma: no cover - non-Linux
        import tempfile

        shm = Path("/dev/shm")
        where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="astralight-slot-", dir=where)
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


def layout_of(shapes: Mapping[str, tuple[int, ...]]) -> tuple[list[list], int]:
    """``[[name, offset, shape], ...]`` of tensors packed back to back, and the element total."""
    out, offset = [], 0
    for name, shape in shapes.items():
        out.append([name, offset, list(shape)])
        offset += int(np.prod(shape, dtype=np.int64))
    return out, offset


def map_slot(fd: int, elements: int, writable: bool) -> np.ndarray:
    """A uint16 array over a slot file descriptor (the mapping outlives the descriptor)."""
    mm = mmap.mmap(fd, max(2 * elements, 2),
                   access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=np.uint16, count=max(elements, 1))
    return arr if writable else arr.view()


def slot_views(buf: np.ndarray, layout: list[list]) -> dict[str, np.ndarray]:
    """Per-tensor views (no copy) of one slot."""
    out = {}
    for name, offset, shape in layout:
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = buf[offset:offset + n].reshape(shape)
    return out


# ----------------------------------------------------------------------------- the process


def _serve(args: argparse.Namespace, commands, answers) -> None:
    from astralight.dataflow.client import DataflowClient

    kw = {} if args.level is None else {"level": args.level}
    builder = PublishBuilder(args.model_id, full_every=args.full_every, threads=args.threads, **kw)
    client = DataflowClient(args.url, retry_s=args.retry_s)
    slots: list[np.ndarray] = []
    layout: list[list] = []
    fds = [int(x) for x in args.slot_fds]
    force_full = False
    try:
        for line in commands:
            if not line.strip():
                continue
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "stop":
                return
            if op == "layout":
                layout = cmd["tensors"]
                slots = [map_slot(fd, int(cmd["elements"]), writable=False) for fd in fds]
                continue
            if op != "job":
                raise ValueError(f"op: unknown command {op!r}")
            version = int(cmd["version"])
            try:
                t0 = time.perf_counter()
                state = slot_views(slots[int(cmd["slot"])], layout)
                full = True if (cmd.get("full") or force_full) else None
                art = builder.build(version, state, full=full)
                t1 = time.perf_counter()
                for name, data in art.files.items():
                    client.upload_weight_file(args.model_id, version, name, data)
                art.manifest.created = float(cmd.get("created") or time.time())
                art.manifest.metadata = {**art.manifest.metadata, **(cmd.get("metadata") or {})}
                client.publish(art.manifest)
                t2 = time.perf_counter()
                force_full = False
                answer = {"ok": True, "version": version,
                          "record": {**artifact_record(art), "encode_s": t1 - t0,
                                     "upload_s": t2 - t1}}
            except Exception as exc:  # report, and make the next version full
                force_full = True
                answer = {"ok": False, "version": version, "error": f"{type(exc).__name__}: {exc}"}
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="WeightPublisher encoder process (started by it)")
    p.add_argument("--url", required=True)
    p.add_argument("--model-id", required=True)
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--level", type=int, default=None)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--nice", type=int, default=0)
    p.add_argument("--retry-s", type=float, default=60.0)
    p.add_argument("--slot-fds", nargs=2, required=True, help="inherited slot file descriptors")
    args = p.parse_args(argv)
    answers = os.fdopen(os.dup(1), "w")  # answers go to the real stdout ...
    os.dup2(2, 1)  # ... and anything a library prints goes to stderr
    sys.stdout = sys.stderr
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError:
            pass
    import warnings

    import torch

    torch.set_num_threads(1)
    # slots are mapped read-only; safetensors only reads the tensors built on them
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    _serve(args, sys.stdin, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
