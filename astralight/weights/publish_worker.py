"""The WeightPublisher's encoder process: builds, uploads and publishes versions outside the trainer.

Both ends of its protocol live here: :class:`ProcessPublisher`, the trainer's worker that copies
snapshots into the slots and hands them over, and the process itself (:func:`main`), which
publishes each with :func:`astralight.weights.publisher.publish_artifact`.

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
* ``{"op": "stop"}`` or end of input: exit. SIGTERM is ignored: a scheduler's SIGTERM to every
  process of the job must not end it before the stopping trainer's last publication.

The process is idle between jobs and runs at a lowered CPU priority (``--nice``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import torch
from torch import Tensor

from astralight.weights.publisher import Job, PublishBuilder, Publisher, publish_artifact
from astralight.weights.slots import layout_of, map_slot, new_slot_fd, slot_views

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- the trainer's side


class _Encoder:
    """The encoder process (:mod:`astralight.weights.publish_worker`): JSON lines over pipes."""

    def __init__(self, args: list[str], slot_fds: list[int], token: str | None):
        env = dict(os.environ)
        # the child imports astralight the way this process does (installed or from a checkout)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p]
                                            + [env.get("PYTHONPATH", "")]).strip(os.pathsep)
        if token:
            env["ASTRALIGHT_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "astralight.weights.publish_worker", *args,
             "--slot-fds", *[str(fd) for fd in slot_fds]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
            pass_fds=slot_fds)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict:
        line = self.proc.stdout.readline()  # blocks without the GIL
        if not line:
            raise RuntimeError(f"the encoder process exited (rc={self.proc.wait()}); see its "
                               "stderr in this log")
        return json.loads(line)

    def close(self, timeout: float) -> None:
        if self.alive():
            try:
                self.send({"op": "stop"})
                self.proc.wait(timeout=timeout)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class ProcessPublisher(Publisher):
    """Hands each snapshot, copied into one of two shared-memory slots, to an encoder process
    that publishes it; this worker thread only waits for the answer, without the GIL.

    The process starts with the first snapshot's layout (or :meth:`prestart`) and is stopped at
    :meth:`close`; one that dies is replaced, and its successor starts with a full version.
    """

    def __init__(self, url: str | None = None, full_every: int = 10,
                 zstd_level: int | None = None, encode_threads: int = 0, nice: int = 0,
                 token: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.url = url
        self.full_every = full_every
        self.zstd_level = zstd_level
        self.encode_threads = encode_threads
        self.nice = nice
        self.token = token
        self._encoder: _Encoder | None = None
        self._slot_fds: list[int] = []
        self._slots: list[dict[str, Tensor]] = []  # per slot: bf16 torch views by name
        self._layout: list[list] = []
        self._layout_key: tuple | None = None

    def submit(self, version, step, state, started, metadata=None) -> None:
        key = tuple((n, tuple(x.shape)) for n, x in state.items())
        if key != self._layout_key:
            self._new_layout(key)
        with self._cv:  # a free slot: the pending one (replaced) or the one not in flight
            if self._pending is not None:
                slot = self._pending.slot
                self._pending = None
                self.replaced += 1
            else:
                slot = 0 if self._inflight_slot != 0 else 1
        views = self._slots[slot]
        for name, x in state.items():
            views[name].copy_(x)  # fp32 -> bf16 round-to-nearest-even, as .to(torch.bfloat16)
        now = time.perf_counter()
        self._enqueue(Job(version, step, time.time(), now, now - started, slot=slot,
                          metadata=metadata))

    def prestart(self, state: dict[str, Tensor]) -> None:
        """Lay out the slots and start the encoder now, so its start-up (imports, ~1-2 s of
        its own CPU) overlaps the first steps instead of delaying the first publications."""
        self._new_layout(tuple((n, tuple(x.shape)) for n, x in state.items()))
        with self._cv:
            self._ensure_encoder()

    def _handle(self, job: Job) -> dict | None:
        with self._cv:
            full = self.force_full
        try:
            encoder = self._ensure_encoder()
            encoder.send({"op": "job", "version": job.version, "step": job.step,
                          "slot": job.slot, "created": job.created, "full": full,
                          "metadata": {"step": job.step, **(job.metadata or {})}})
            answer = encoder.recv()
        except Exception:
            self._close_encoder(0)  # a new process starts from a full version
            raise
        if answer.get("version") != job.version:
            self._close_encoder(0)
            raise RuntimeError(f"the encoder answered for version {answer.get('version')}, "
                               f"expected {job.version}")
        if not answer.get("ok"):
            log.error("publishing version %d of %r failed in the encoder: %s; the next version "
                      "will be full", job.version, self.model_id, answer.get("error"))
            self._failed(job, str(answer.get("error")))
            return None
        return answer["record"]

    def _forget_base(self, restart: bool) -> None:
        if restart:
            self._close_encoder(0)  # a new encoder starts from a full version

    def _abort(self) -> None:
        self._close_encoder(0)  # unblocks a worker waiting for an answer

    def _release(self) -> None:
        self._close_encoder()
        self._close_slots()

    def _new_layout(self, key: tuple) -> None:
        """(Re)create the two snapshot slots for these names/shapes; the encoder restarts
        (rare: the first snapshot, or a model whose tensors changed), waiting for it first."""
        if self._layout_key is not None:
            self.flush(self.flush_timeout_s)
        with self._cv:
            self._close_encoder()
            self._close_slots()
            self._layout, elements = layout_of(dict(key))
            self._slot_fds = [new_slot_fd(elements) for _ in range(2)]
            self._slots = []
            for fd in self._slot_fds:
                bits = map_slot(fd, elements, writable=True)
                self._slots.append({n: torch.from_numpy(v).view(torch.bfloat16)
                                    for n, v in slot_views(bits, self._layout).items()})
            self._layout_key = key

    def _close_slots(self) -> None:
        for fd in self._slot_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._slot_fds, self._slots, self._layout_key = [], [], None

    def _close_encoder(self, timeout: float = 30.0) -> None:
        if self._encoder is not None:
            self._encoder.close(timeout)
            self._encoder = None

    def _ensure_encoder(self) -> _Encoder:
        if self._encoder is not None and not self._encoder.alive():
            self._close_encoder(0)
        if self._encoder is None:
            if not self.url:
                raise ValueError("dataflow_url: not set and the datamodule has none; set "
                                 "callbacks[WeightPublisher].init_args.dataflow_url")
            args = ["--url", self.url, "--model-id", self.model_id,
                    "--full-every", str(self.full_every), "--threads", str(self.encode_threads),
                    "--nice", str(self.nice)]
            if self.zstd_level is not None:
                args += ["--level", str(self.zstd_level)]
            encoder = _Encoder(args, self._slot_fds, self.token)
            elements = sum(int(np.prod(shape, dtype=np.int64)) for _, _, shape in self._layout)
            encoder.send({"op": "layout", "elements": elements, "tensors": self._layout})
            self._encoder = encoder
        return self._encoder


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
                full = True if (cmd.get("full") or force_full) else None
                _, record = publish_artifact(
                    client, args.model_id, version,
                    lambda: builder.build(version, slot_views(slots[int(cmd["slot"])], layout),
                                          full=full),
                    float(cmd.get("created") or time.time()), cmd.get("metadata") or {})
                force_full = False
                answer = {"ok": True, "version": version, "record": record}
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
    # The trainer ends this process (a stop op, or end of input when the trainer exits, even by
    # SIGKILL). A SIGTERM meant for the whole job (Slurm's scancel and time limit signal every
    # process of a step at once) must not kill it while the stopping trainer publishes its last
    # version through it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w")  # answers go to the real stdout ...
    os.dup2(2, 1)  # ... and anything a library prints goes to stderr
    sys.stdout = sys.stderr
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError:
            pass
    import warnings

    torch.set_num_threads(1)
    # slots are mapped read-only; safetensors only reads the tensors built on them
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    _serve(args, sys.stdin, answers)
    return 0


__all__ = ["ProcessPublisher", "main"]


if __name__ == "__main__":
    sys.exit(main())
