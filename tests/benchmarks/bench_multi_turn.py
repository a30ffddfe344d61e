"""Multi-turn episodes: the episode runner against the old lock-step runner, in one invocation.

    python tests/benchmarks/bench_multi_turn.py [--json] [--episodes 64] [--repeats 2]

Episodes of 1-8 turns (uniform, seeded) on the tiny model served by a real vLLM engine; every
environment step sleeps a heavy-tailed latency (log-normal, median ``--median-ms``, sigma
``--sigma``, capped at ``--cap-ms``; the same draw for the same episode and turn in both arms),
as tool calls, games and web calls do. Arms, alternated ``--repeats`` times:

- ``new``: :class:`astralight.workflows.multi_turn.MultiTurnWorkflow` as the RaaS runs it, every
  episode its own coroutine (environment steps on executor threads, turns submitted as soon as
  their own step returns);
- ``lockstep``: the runner this replaced, kept here only as the baseline: all episodes advance
  together, one batched generate call per turn for every live episode, then each episode's
  environment step in turn.

Prints one JSON line: ``episodes_per_s_new``, ``episodes_per_s_lockstep`` (medians),
``speedup`` (= new / lockstep), every repeat, the turn and latency figures and the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def latency_table(episodes: int, max_turns: int, median_ms: float, sigma: float, cap_ms: float,
                  seed: int = 0) -> tuple[list[int], list[list[float]]]:
    """Per episode its number of turns (1..max_turns) and each turn's step latency (s)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    turns = [int(t) for t in rng.integers(1, max_turns + 1, episodes)]
    lat = [[min(cap_ms, median_ms * math.exp(sigma * float(rng.standard_normal()))) / 1000.0
            for _ in range(max_turns)] for _ in range(episodes)]
    return turns, lat


class LatencyEnv:
    """Done after the episode's drawn number of turns; each step sleeps its drawn latency."""

    table: dict[str, tuple[int, list[float]]] = {}

    def reset(self, task) -> str:
        self.turns, self.latency = self.table[task.task_id]
        self.k = 0
        return task.prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        time.sleep(self.latency[self.k])
        self.k += 1
        return ";", 0.0, self.k >= self.turns


def run_new(workflow, tasks, engine) -> float:
    """Every episode its own coroutine (as the RaaS's episode runner); wall seconds."""
    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=len(tasks) + 4))
        t = time.perf_counter()
        await asyncio.gather(*(workflow.run(task, {"policy": engine}) for task in tasks))
        return time.perf_counter() - t

    return asyncio.run(main())


def run_lockstep(workflow, tasks, engine) -> float:
    """The replaced runner: one generate call per turn for all live episodes, then each
    episode's environment step in turn; wall seconds."""
    from astralight.workflows.single_turn import SingleTurnWorkflow

    tok = engine.tokenizer
    t = time.perf_counter()
    live = []
    for task in tasks:
        env = LatencyEnv()
        ids = list(tok(env.reset(task), add_special_tokens=False)["input_ids"])
        live.append((env, ids))
    for _ in range(workflow.max_turns):
        comps = engine.generate_batch([ids for _, ids in live], workflow.sampling)
        still = []
        for (env, ids), comp in zip(live, comps):
            ids.extend(comp.token_ids)
            obs, _, done = env.step(SingleTurnWorkflow.decode(tok, comp))
            if not done:
                ids.extend(tok(obs, add_special_tokens=False)["input_ids"])
                still.append((env, ids))
        live = still
        if not live:
            break
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--median-ms", type=float, default=20.0)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--cap-ms", type=float, default=1000.0)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from astralight.engine import SamplingSpec
    from astralight.protocol import Task
    from astralight.raas.vllm_engine import VLLMEngine
    from astralight.trainer.tinymodel import build_tiny_model_folder
    from astralight.workflows.multi_turn import MultiTurnWorkflow

    turns, lat = latency_table(args.episodes, args.max_turns, args.median_ms, args.sigma,
                               args.cap_ms)
    tasks = [Task(task_id=f"e{i}", prompt=f"{i % 50}+{(7 * i) % 50}=", n=1, model_ids=["policy"],
                  workflow="multi_turn") for i in range(args.episodes)]
    LatencyEnv.table = {t.task_id: (turns[i], lat[i]) for i, t in enumerate(tasks)}
    workflow = MultiTurnWorkflow(LatencyEnv, max_turns=args.max_turns,
                                 sampling=SamplingSpec(temperature=1.0, max_tokens=args.max_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model_folder(os.path.join(tmp, "model"))
        engine = VLLMEngine(str(folder), dtype="bfloat16", max_model_len=128, seed=0,
                            kv_cache_memory_bytes=64 << 20, warmup=True)
        load_before = os.getloadavg()
        walls: dict[str, list[float]] = {"new": [], "lockstep": []}
        for _ in range(args.repeats):
            walls["lockstep"].append(run_lockstep(workflow, tasks, engine))
            walls["new"].append(run_new(workflow, tasks, engine))
        engine.close()
    rate = {k: [round(args.episodes / w, 2) for w in v] for k, v in walls.items()}
    new, old = statistics.median(rate["new"]), statistics.median(rate["lockstep"])
    step_s = [lat[i][k] for i in range(args.episodes) for k in range(turns[i])]
    result = {
        "episodes_per_s_new": new, "episodes_per_s_lockstep": old,
        "speedup": round(new / old, 2), "repeats": rate, "episodes": args.episodes,
        "turns_mean": round(statistics.mean(turns), 2), "env_steps": len(step_s),
        "env_step_s": {"median": round(statistics.median(step_s), 4),
                       "mean": round(statistics.mean(step_s), 4), "max": round(max(step_s), 4),
                       "sum": round(sum(step_s), 2)},
        "cpu_count": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    if not args.json:
        print(f"{args.episodes} episodes: new {new:.1f}/s, lock-step {old:.1f}/s, speedup "
              f"{new / old:.1f}x", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
