"""A real pretrained model on two CPU cores: what SmolLM2-135M-Instruct costs each part (issue 38).

    python tests/benchmarks/bench_smollm2.py --json [--versions 4] [--arms lora,full]

Arms, in one invocation, each from the same converted model folder
(:func:`astralight.pretrained.prepare_smollm2`, once per machine):

- ``shapes``: the model as it comes, on candidate task shapes (bare sums ``What is a+b?`` and
  word problems, operand ranges, temperature 1.0 and 0.7), 48 prompts x 4 samples each through
  the engine: the share answered right by the last number of the reply, and the reply lengths.
  This is how the example's task was chosen: wrong often, not always;
- ``engine``: the RaaS engine alone (:class:`~astralight.raas.vllm_engine.VLLMEngine`, the
  recipe's dtype and context), one call of ``--requests`` held-out word problems at the
  recipe's sampling: generated tokens per second, the prompt and completion lengths, the
  engine's start time;
- ``lora`` and ``full``: ``examples/smollm2_math/recipe.yaml`` run by the launcher for
  ``--versions`` versions (``full``: the same recipe with ``lora`` off and the engine's LoRA
  support off, so full weights are trained and published). From the trainer's TensorBoard:
  samples/s and tokens/s of its steps (``perf/``), and per publication its kind (full or
  delta), bytes, the bytes a full sync would move, the compression, the share of bf16 elements
  that did not change (the delta's sparsity at a real model's update size) and the latency;
  from ``/proc``: the peak resident memory of each component (the launcher's process tree,
  sampled every second).

Prints one JSON object per arm (``--json``), then ``{"summary": ...}``: the medians per arm
and the machine's load before and after. Asserts nothing: a benchmark reports.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.benchmarks.bench_examples_learn import (_load, example_recipe, log, one_run,  # noqa: E402
                                                   run_recipe)

EXAMPLE = "smollm2_math"
PERF_TAGS = ("perf/samples_per_s", "perf/tokens_per_s", "perf/step_compute_s")
PUBLISH_TAGS = ("publish/kind", "publish/bytes", "publish/full_bytes", "publish/compression_ratio",
                "publish/sparsity", "publish/latency_s", "publish/encode_s", "publish/upload_s")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


# ------------------------------------------------------------------------------ engine arm


def engine_spec(model: Path, recipe: dict, lora: bool = True) -> dict:
    """The recipe's engine arguments for ``model`` (its ``model_path`` left out; without
    ``lora``, the engine's LoRA support off)."""
    from astralight.launch.recipe import substitute

    spec = substitute(copy.deepcopy(recipe["raas"][0]["engines"]["policy"]),
                      {"init_model": model, "run_dir": model.parent, "seed": 0})
    spec.pop("model_path")
    if not lora:
        spec.pop("enable_lora", None)
        spec.pop("max_lora_rank", None)
    return spec


def engine_arm(model: Path, recipe: dict, requests: int) -> dict:
    """One call of ``requests`` eval prompts through the RaaS engine: tokens per second."""
    from astralight.engine import SamplingSpec
    from astralight.raas.vllm_engine import VLLMEngine
    from astralight.tasks.word_problems import WordProblemSource
    from astralight.workflows.base import tokenize_prompt

    spec = engine_spec(model, recipe)
    sampling = recipe["raas"][0]["workflow"]["init_args"]["sampling"]
    source_args = dict(recipe["dataflow"]["eval"]["source"]["init_args"])
    source_args["eval_size"] = requests
    source = WordProblemSource(**source_args)
    t0 = time.monotonic()
    engine = VLLMEngine(str(model), **spec)
    start_s = time.monotonic() - t0
    try:
        prompts = [tokenize_prompt(engine.tokenizer, source.get(i).prompt) for i in range(len(source))]
        params = SamplingSpec(temperature=float(sampling["temperature"]),
                              max_tokens=int(sampling["max_tokens"]))

        async def all_at_once():
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

        t1 = time.monotonic()
        outs = asyncio.run(all_at_once())
        seconds = time.monotonic() - t1
    finally:
        engine.close()
    tokens = [len(o.token_ids) for o in outs]
    return {"arm": "engine", "requests": len(prompts), "engine_start_s": round(start_s, 1),
            "seconds": round(seconds, 2), "generated_tokens": sum(tokens),
            "tokens_per_s": round(sum(tokens) / seconds, 1),
            "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
            "completion_tokens_mean": round(sum(tokens) / len(tokens), 1),
            "truncated_share": round(sum(o.finish_reason == "length" for o in outs) / len(outs), 3),
            "dtype": spec.get("dtype")}


SHAPES = {  # name: (kind, WordProblemSource / bare-sum kwargs)
    "bare 1-9": ("bare", {"lo": 1, "hi": 9}),
    "bare 1-20": ("bare", {"lo": 1, "hi": 20}),
    "bare 10-99": ("bare", {"lo": 10, "hi": 99}),
    "word +, 1-9": ("word", {"ops": "+", "min_operand": 1, "max_operand": 9}),
    "word +-, 1-9": ("word", {"ops": "+-", "min_operand": 1, "max_operand": 9}),  # the example's
    "word +-, 2-20": ("word", {"ops": "+-", "min_operand": 2, "max_operand": 20}),
}


def shape_prompts(kind: str, kwargs: dict, n: int, seed: int = 0) -> list[tuple[list, str]]:
    """``n`` (chat messages, answer) pairs of one task shape."""
    import numpy as np

    from astralight.tasks.word_problems import WordProblemSource

    if kind == "word":
        src = WordProblemSource("eval", eval_size=n, instruction="Answer with the number.", **kwargs)
        return [(src.get(i).prompt, src.get(i).metadata["answer"]) for i in range(len(src))]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(kwargs["lo"], kwargs["hi"] + 1, 2))
        out.append(([{"role": "user", "content": f"What is {a}+{b}? Answer with the number."}],
                    str(a + b)))
    return out


def shapes_arm(model: Path, recipe: dict, max_tokens: int = 48) -> list[dict]:
    """The untrained model's accuracy (last number of the reply) per task shape and temperature."""
    from astralight.engine import SamplingSpec
    from astralight.raas.vllm_engine import VLLMEngine
    from astralight.rewards.math import last_number
    from astralight.workflows.base import tokenize_prompt

    engine = VLLMEngine(str(model), **engine_spec(model, recipe, lora=False))
    rows = []
    try:
        for name, (kind, kwargs) in SHAPES.items():
            items = shape_prompts(kind, kwargs, 48)
            for temperature in (1.0, 0.7):
                params = SamplingSpec(temperature=temperature, max_tokens=max_tokens)

                async def all_at_once():
                    return await asyncio.gather(*(
                        engine.generate(tokenize_prompt(engine.tokenizer, p), params)
                        for p, _ in items for _ in range(4)))

                outs = asyncio.run(all_at_once())
                golds = [g for _, g in items for _ in range(4)]
                texts = [engine.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
                right = [last_number(t) == g for t, g in zip(texts, golds)]
                rows.append({"arm": "shapes", "shape": name, "temperature": temperature,
                             "accuracy": round(sum(right) / len(right), 3),
                             "tokens_mean": round(sum(len(o.token_ids) for o in outs) / len(outs), 1),
                             "truncated_share": round(sum(o.finish_reason == "length" for o in outs)
                                                      / len(outs), 3),
                             "example": texts[0][:200]})
    finally:
        engine.close()
    return rows


# ------------------------------------------------------------------------------ run arms


class PeakMemory:
    """Peak resident memory per component while the block runs: every second, each component
    the launcher lists in ``RUN_DIR/pids.json`` (``{component: pid}``) with its children."""

    def __init__(self, pids_file: Path):
        self.pids_file = pids_file
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        import psutil

        while not self._stop.wait(1.0):
            try:
                pids = json.loads(self.pids_file.read_text())
            except (OSError, ValueError):
                continue
            for name, pid in pids.items():
                try:
                    proc = psutil.Process(int(pid))
                    rss = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
                except (psutil.Error, ValueError):
                    continue
                self.peaks[name] = max(self.peaks.get(name, 0.0), rss / 2**30)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def tensorboard_figures(run_dir: Path) -> dict[str, Any]:
    """The trainer's per-step perf figures and per-version publication figures (joined by step:
    some publication tags, e.g. the sparsity, are missing on the first version)."""
    from astralight.report.rundata import load_run

    scalars = load_run(run_dir).scalars
    series = next(iter(scalars.values()), {})
    by_step = {t: dict(series.get(t, [])) for t in PERF_TAGS + PUBLISH_TAGS}
    pubs = [{t: by_step[t].get(step) for t in PUBLISH_TAGS} for step in sorted(by_step["publish/kind"])]
    full = [p for p in pubs if p["publish/kind"] == 1]
    delta = [p for p in pubs if p["publish/kind"] == 0]

    def med(rows, key):
        return _median([r[key] for r in rows if r[key] is not None])

    # the first step pays the trainer's warm-up: the medians leave it out when there are more
    perf = {t: [v for _, v in sorted(by_step[t].items())] for t in PERF_TAGS}
    perf = {t: values[1:] or values for t, values in perf.items()}
    return {
        "trainer_samples_per_s": _median(perf["perf/samples_per_s"]),
        "trainer_tokens_per_s": _median(perf["perf/tokens_per_s"]),
        "trainer_step_s": _median(perf["perf/step_compute_s"]),
        "publications": len(pubs),
        "full": {"n": len(full), "bytes": med(full, "publish/bytes"),
                 "latency_s": med(full, "publish/latency_s")},
        "delta": {"n": len(delta), "bytes": med(delta, "publish/bytes"),
                  "full_bytes": med(delta, "publish/full_bytes"),
                  "compression_ratio": med(delta, "publish/compression_ratio"),
                  "unchanged_bf16_share": med(delta, "publish/sparsity"),
                  "latency_s": med(delta, "publish/latency_s"),
                  "encode_s": med(delta, "publish/encode_s")},
    }


def arm_recipe(base: dict, arm: str, versions: int) -> dict:
    recipe = run_recipe(base, 0, None, versions, [])
    if arm == "full":
        recipe["trainers"][0]["model"]["init_args"]["lora"] = None
        for raas in recipe["raas"]:
            for engine in raas["engines"].values():
                engine.pop("enable_lora", None)
                engine.pop("max_lora_rank", None)
    return recipe


def run_arm(base: dict, arm: str, versions: int, prepared: Path, out: Path, quiet: bool) -> dict:
    recipe = arm_recipe(base, arm, versions)
    run_dir = out / arm
    with PeakMemory(run_dir / "pids.json") as memory:
        row = one_run(EXAMPLE, recipe, prepared, run_dir, "quiet", quiet)
    row.update(arm=arm, peak_rss_gib={k: round(v, 2) for k, v in sorted(memory.peaks.items())},
               **tensorboard_figures(run_dir))
    return row


def main(argv: list[str] | None = None) -> int:
    from astralight.pretrained import prepare_smollm2

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default="engine,lora,full", help="any of shapes,engine,lora,full")
    ap.add_argument("--versions", type=int, default=4, help="versions per run arm")
    ap.add_argument("--requests", type=int, default=64, help="prompts in the engine arm's call")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench_smollm2")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no launcher lines on stderr")
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - {"shapes", "engine", "lora", "full"}
    if unknown:
        raise SystemExit(f"--arms: unknown {sorted(unknown)}; choose from shapes, engine, lora, full")
    base = example_recipe(EXAMPLE)
    prepared = args.out_dir / "_prepared"
    model = prepared / "models" / "init"
    if not (model / "config.json").exists():
        prepare_smollm2(model)
    load_before = _load()
    rows = []
    for arm in arms:
        log(f"[bench_smollm2] {arm}: start (load {_load()})")
        if arm == "shapes":
            for row in shapes_arm(model, base):
                print(json.dumps(row) if args.json else row, flush=True)
            continue
        row = (engine_arm(model, base, args.requests) if arm == "engine"
               else run_arm(base, arm, args.versions, prepared, args.out_dir, args.quiet))
        rows.append(row)
        print(json.dumps(row) if args.json else row, flush=True)
    summary = {"load_before": load_before, "load_after": _load(), "cpu_count": os.cpu_count(),
               **{r["arm"]: {k: r.get(k) for k in ("tokens_per_s", "trainer_samples_per_s",
                                                   "trainer_tokens_per_s", "full", "delta",
                                                   "peak_rss_gib", "exit_code") if k in r}
                  for r in rows}}
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
