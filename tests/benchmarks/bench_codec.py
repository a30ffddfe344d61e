"""CPU per sample of the wire codec (:mod:`astralight.protocol`), this tree against a git ref.

    python tests/benchmarks/bench_codec.py --json [--baseline-ref 7ecf2e4] [--tokens 8 256]

Every sample crosses the codec three to four times: the RaaS encodes it in a push, the dataflow
decodes the push and encodes the sample again for its SQLite row, and again in the trainer's
batch, which the trainer decodes. With the discovery task's 8-token samples the codec was most
of the dataflow's CPU (py-spy of the facts run: ``push_many`` 37%, ``encode`` 17%), on the core
it shares with the trainer.

Arms, in one invocation and one process, interleaved ``--repeat`` times (median reported):

- ``baseline``: ``astralight/protocol.py`` as it is at ``--baseline-ref`` (read with
  ``git show``, imported as a module of its own next to this tree's other modules);
- ``current``: this tree's ``astralight.protocol``.

Each arm encodes and decodes the same ``push_many`` body: 16 tasks of 8 samples of ``--tokens``
tokens each (5 prompt tokens, the rest generated), as a RaaS sends it. Both arms' decodes are
checked to give the same samples.

Prints JSON: per token count, each arm's encode and decode CPU microseconds per sample
(process CPU time, robust to other processes on shared cores), ``ratio_encode`` and
``ratio_decode`` (= current / baseline), and the machine's load before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TASKS, GROUP, PROMPT = 16, 8, 5


def load_baseline(ref: str):
    """``astralight/protocol.py`` at ``ref`` as a module named ``protocol_at_ref``."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:astralight/protocol.py"],
                         check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:  # executed once; the file is not needed after
        path = Path(tmp) / "protocol_at_ref.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("protocol_at_ref", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["protocol_at_ref"] = mod  # dataclasses look their module up while building
        spec.loader.exec_module(mod)
    return mod


def push_body(proto, tokens: int) -> dict:
    """A push_many body of ``TASKS`` x ``GROUP`` samples built with ``proto``'s Sample."""
    gen = tokens - PROMPT
    rng = np.random.default_rng(0)

    def sample(t: int, j: int):
        return proto.Sample(
            task_id=f"task-{t:06d}", sample_index=j, model_id="policy",
            token_ids=rng.integers(0, 64, tokens).astype(np.int32),
            logprobs=np.r_[np.zeros(PROMPT), -rng.random(gen)].astype(np.float32),
            loss_mask=np.r_[np.zeros(PROMPT), np.ones(gen)].astype(np.uint8),
            versions=np.r_[-np.ones(PROMPT), np.full(gen, 3)].astype(np.int32),
            reward=float(j % 2), prompt_len=PROMPT,
            metadata={"temperature": 1.0, "finish_reason": "stop"})

    return {"instance_id": "raas-0",
            "items": [{"task_id": f"task-{t:06d}", "samples": [sample(t, j) for j in range(GROUP)]}
                      for t in range(TASKS)]}


def us_per_sample(fn, n_samples: int, min_s: float = 0.3) -> float:
    """CPU microseconds per sample of ``fn`` (which handles ``n_samples``), over at least
    ``min_s`` of CPU."""
    fn()  # warm
    calls, start = 0, time.process_time()
    while True:
        fn()
        calls += 1
        spent = time.process_time() - start
        if spent >= min_s:
            return spent / calls / n_samples * 1e6


def same_samples(a: dict, b: dict) -> bool:
    for ia, ib in zip(a["items"], b["items"]):
        for sa, sb in zip(ia["samples"], ib["samples"]):
            for f in ("token_ids", "logprobs", "loss_mask", "versions"):
                if not np.array_equal(getattr(sa, f), getattr(sb, f)):
                    return False
            if (sa.reward, sa.task_id, sa.metadata) != (sb.reward, sb.task_id, sb.metadata):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-ref", default="7ecf2e4",
                    help="git ref whose protocol.py is the baseline arm (default: the codec "
                         "before its fast paths)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 256])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    from astralight import protocol as current

    arms = {"baseline": load_baseline(args.baseline_ref), "current": current}
    n = TASKS * GROUP
    out: dict = {"bench": "codec", "baseline_ref": args.baseline_ref, "samples_per_body": n,
                 "load_before": [round(x, 2) for x in os.getloadavg()]}
    for tokens in args.tokens:
        bodies = {name: push_body(p, tokens) for name, p in arms.items()}
        wires = {name: arms[name].encode(bodies[name]) for name in arms}
        if wires["baseline"] != wires["current"]:
            raise SystemExit(f"tokens={tokens}: the arms encode the same body differently")
        decoded = {name: p.decode(wires[name]) for name, p in arms.items()}
        if not same_samples(decoded["baseline"], decoded["current"]):
            raise SystemExit(f"tokens={tokens}: the arms decode the same bytes differently")
        runs: dict = {f"{name}_{op}": [] for name in arms for op in ("encode", "decode")}
        for _ in range(args.repeat):
            for name, p in arms.items():
                runs[f"{name}_encode"].append(us_per_sample(lambda: p.encode(bodies[name]), n))
                runs[f"{name}_decode"].append(us_per_sample(lambda: p.decode(wires[name]), n))
        fig = {k: round(statistics.median(v), 2) for k, v in runs.items()}
        fig["ratio_encode"] = round(fig["current_encode"] / fig["baseline_encode"], 3)
        fig["ratio_decode"] = round(fig["current_decode"] / fig["baseline_decode"], 3)
        fig["bytes_per_sample"] = round(len(wires["current"]) / n, 1)
        out[f"tokens_{tokens}_us_per_sample"] = fig
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
