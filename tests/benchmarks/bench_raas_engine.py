"""The RaaS engine path against one offline vLLM call, on the same engine, in one invocation.

    python tests/benchmarks/bench_raas_engine.py [--json] [--requests 256] [--episodes 32]
        [--max-tokens 275] [--repeats 2]

A small random Qwen3 model (tiny model shape, 512-token context) and ``--requests`` prompts of
16 random tokens, sampled at temperature 1.0 up to ``--max-tokens``: a random model's EOS ends
completions at random, which gives the long tail of agentic rollouts (measured: p50 ~60, p90
~200, max 275 tokens). Arms, alternated ``--repeats`` times:

- ``one_call``: every request in one ``LLM.generate`` call (vLLM's own batch, the ceiling);
- ``raas``: the same requests through the RaaS engine contract from ``--episodes`` concurrent
  episodes (coroutines on one event loop), each awaiting ``generate_many`` of its share, as the
  episode runner drives it (continuous batching on the step driver).

Then the weight-update pause with ``--episodes`` requests in flight: a full state dict loaded
while they run (the engine applies it between two steps); every request must come back with
per-token versions covering both sides.

Prints one JSON line: ``one_call_tok_s``, ``raas_tok_s`` (medians), ``ratio`` (= raas / one call),
every repeat's figures, the length distribution, ``weight_pause_s`` and the machine's load.
Asserts nothing: a benchmark reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time


def _percentiles(values: list[int]) -> dict:
    v = sorted(values)
    return {"p50": v[len(v) // 2], "p90": v[int(0.9 * (len(v) - 1))], "max": v[-1]}


def one_call(engine, prompts, spec) -> tuple[float, list[int]]:
    """All prompts in one offline ``LLM.generate`` (on the driver thread, which owns vLLM)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_tokens, logprobs=0,
                            detokenize=False)
    t = time.perf_counter()
    outs = engine._driver.call(lambda: engine.llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    dt = time.perf_counter() - t
    lens = [len(o.outputs[0].token_ids) for o in outs]
    return sum(lens) / dt, lens


def raas_path(engine, prompts, spec, episodes: int) -> tuple[float, list[int]]:
    """The same prompts from ``episodes`` concurrent coroutines through the async contract."""
    shares = [prompts[i::episodes] for i in range(episodes)]

    async def main():
        t = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate_many(share, spec) for share in shares))
        return time.perf_counter() - t, [len(c.token_ids) for out in outs for c in out]

    dt, lens = asyncio.run(main())
    return sum(lens) / dt, lens


def inflight_update(engine, prompts, spec, state) -> dict:
    """Load ``state`` while ``len(prompts)`` requests run; the pause and the version spans."""
    async def main():
        tasks = [asyncio.create_task(engine.generate(p, spec)) for p in prompts]
        start = engine.steps_run
        # a prefill and a few decode steps in (fewer for short completions: with --max-tokens 6
        # every request may end within 8 steps, and waiting for the 8th step would never end)
        steps_in = min(8, max(1, spec.max_tokens // 2))
        while engine.steps_run - start < steps_in and not all(t.done() for t in tasks):
            await asyncio.sleep(0.002)
        t = time.perf_counter()
        await asyncio.to_thread(engine.update_weights, state, engine.version + 1)
        call_s = time.perf_counter() - t
        return call_s, await asyncio.gather(*tasks)

    call_s, comps = asyncio.run(main())
    return {"weight_pause_s": round(engine.weight_pause_s_last, 4),
            "update_call_s": round(call_s, 4), "inflight_requests": len(comps),
            "completions_spanning_versions": sum(c.spans_versions for c in comps),
            "mis_stamped": sum(len(c.versions) != len(c.token_ids) for c in comps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=275)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    import numpy as np

    from astralight.engine import SamplingSpec
    from astralight.raas.vllm_engine import VLLMEngine
    from astralight.trainer.tinymodel import TinyModelSpec, build_model, build_tiny_model_folder

    shape = TinyModelSpec(max_position_embeddings=512, seed=3)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model_folder(os.path.join(tmp, "model"), shape)
        engine = VLLMEngine(str(folder), dtype="bfloat16", max_model_len=512, seed=0,
                            kv_cache_memory_bytes=256 << 20, warmup=True)
        rng = np.random.default_rng(0)
        prompts = [[int(x) for x in rng.integers(3, 90, 16)] for _ in range(args.requests)]
        spec = SamplingSpec(temperature=1.0, max_tokens=args.max_tokens)
        load_before = os.getloadavg()
        figures: dict[str, list[float]] = {"one_call": [], "raas": []}
        lengths: list[int] = []
        for _ in range(args.repeats):
            rate, lengths = one_call(engine, prompts, spec)
            figures["one_call"].append(round(rate, 1))
            rate, _ = raas_path(engine, prompts, spec, args.episodes)
            figures["raas"].append(round(rate, 1))
        new = {k: v.detach() for k, v in build_model(TinyModelSpec(
            max_position_embeddings=512, seed=4)).state_dict().items()}
        update = inflight_update(engine, prompts[:args.episodes], spec, new)
        engine.close()
    one, raas = statistics.median(figures["one_call"]), statistics.median(figures["raas"])
    result = {
        "one_call_tok_s": round(one, 1), "raas_tok_s": round(raas, 1),
        "ratio": round(raas / one, 3), "repeats": figures, "requests": args.requests,
        "episodes": args.episodes, "completion_tokens": _percentiles(lengths),
        **update, "engine_start_s": round(engine.start_s, 2),
        "warmup_s": round(engine.warmup_s, 2), "cpu_count": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    if not args.json:
        print(f"one call {one:.0f} tok/s | RaaS path from {args.episodes} episodes {raas:.0f} "
              f"tok/s | ratio {raas / one:.2f} | pause with {update['inflight_requests']} in flight "
              f"{update['weight_pause_s']:.3f} s", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
