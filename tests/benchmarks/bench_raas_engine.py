"""Benchmark of the RaaS vLLM engine on this machine: prints figures, asserts nothing.

    python tests/benchmarks/bench_raas_engine.py [--prompts 64] [--max-tokens 4] [--repeats 20]

Measures, for the tiny model: ``import vllm``, engine start (``vllm.LLM``), the first generate
(one-time warm-up), steady generation of the toy task ("37+45=" style prompts), and the weight
refresh pause (``update_weights`` of a full state dict: serialize, collective_rpc, reload, reset
prefix cache). Model folder is built fresh in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from astralight.raas.engine import SamplingSpec
    from astralight.tasks.arithmetic import ArithmeticSource
    from astralight.tinymodel import TinyModelSpec, build_model, build_tiny_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model_folder(os.path.join(tmp, "model"))
        t = time.perf_counter()
        import vllm  # noqa: F401

        import_s = time.perf_counter() - t
        from astralight.raas.vllm_engine import VLLMEngine

        engine = VLLMEngine(str(folder), dtype="bfloat16", max_model_len=128, seed=0,
                            kv_cache_memory_bytes=64 << 20, warmup=True)
        src = ArithmeticSource(seed=0)
        prompts = [engine.tokenizer(src.get(i).prompt, add_special_tokens=False)["input_ids"]
                   for i in range(args.prompts)]
        spec = SamplingSpec(temperature=1.0, max_tokens=args.max_tokens)
        times, tokens = [], 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = engine.generate(prompts, spec)
            times.append(time.perf_counter() - t)
            tokens += sum(len(c.token_ids) for c in out)
        new = {k: v.detach() for k, v in build_model(TinyModelSpec(seed=1)).state_dict().items()}
        pauses = []
        for i in range(args.repeats):
            t = time.perf_counter()
            engine.update_weights(new, version=i + 1)
            pauses.append(time.perf_counter() - t)
        engine.close()

    med = statistics.median(times)
    print(f"cpu cores: {os.cpu_count()}  python {sys.version.split()[0]}")
    print(f"import vllm:            {import_s:.2f} s")
    print(f"engine start (LLM()):   {engine.start_s:.2f} s")
    print(f"first generate warm-up: {engine.warmup_s:.2f} s")
    print(f"{args.prompts} prompts x <= {args.max_tokens} tokens: median {med * 1e3:.1f} ms "
          f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}); "
          f"{tokens / sum(times):.0f} generated tokens/s")
    print("per-call ms: " + " ".join(f"{x * 1e3:.0f}" for x in times))
    print(f"weight refresh pause (full tiny state, {len(new)} tensors): median "
          f"{statistics.median(pauses) * 1e3:.1f} ms (max {max(pauses) * 1e3:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
