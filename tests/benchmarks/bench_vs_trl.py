"""Time-to-accuracy against TRL on a discovery task, both arms in one invocation.

    python tests/benchmarks/bench_vs_trl.py --json [--budget-s 600] [--png acc.png]

Needs the ``bench`` extra (``pip install -e ".[bench]"``: TRL).

The task (:mod:`astralight.tasks.facts`): 200 arbitrary facts ``"f042=" -> "7"``; the tiny
model's warm start (built once, shared by both arms) saw a quarter of them, so on the others it
can only learn from rewarded samples at temperature 1.0. The eval set is those unseen facts.

Arms, one after the other, each for the same wall-clock budget counted from its start (so
astralight's start-up -- the recipe check, three processes, the vLLM engine -- is in its
budget, as a user waits for it):

- ``astra``: ``astralight run`` on the toy recipe (examples/toy/recipe.yaml) with the task
  swapped in, stopped by ``stop.max_wall_s``; ``--astra-set KEY=VALUE`` changes any recipe key
  (dotted path, list items by index, e.g. ``trainers.0.model.init_args.lr=1e-3``). A watcher
  reads the latest published weights from the run's dataflow at every eval point.
- ``trl``: TRL's ``GRPOTrainer`` in one process (transformers generation on CPU), 8 samples per
  prompt, 64 completions per step, beta 0, learning rate ``--trl-lr``; a callback keeps the
  weights at every eval point and stops at the budget.

Both arms' weights are kept in bf16 (what astralight publishes) at ``--points`` evenly spaced
wall times, and evaluated afterwards by the same code: avg@4 exact match at temperature 1.0
over the unseen facts (:func:`astralight.tasks.warmstart.sample_completions`, one seed).

Prints one JSON object: ``astra_acc_at_budget``, ``trl_acc_at_budget``, ``trl_best``,
``astra_wall_to_trl_best`` (first eval point where astralight reached TRL's best; null if
never), ``trl_wall_to_trl_best``, ``ratio_wall_to_trl_best`` (astra / trl), samples and
optimizer steps of each arm at the budget, both curves, and the machine's load. An arm left out
with ``--arms`` has null figures and curve.
"""

from __future__ import annotations

import argparse
import copy
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
#: the task: the FactTable / FactSource arguments (both arms and the warm start)
TABLE = {"num_keys": 200, "seen_share": 0.25, "answer_len": 1, "seed": 0}
WARM_START = {"sft_steps": 300, "label_smoothing": 0.2, "num_threads": 1}
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


def build_init(out: Path) -> Path:
    from astralight.tasks.facts import build_facts_policy

    if not (out / "config.json").exists():
        build_facts_policy(out, progress=False, **TABLE, **WARM_START)
    return out


def evaluate(init: Path, snapshot: Path | None, k: int = 4, seed: int = 0) -> float:
    """avg@k exact match at temperature 1.0 over the unseen facts, with ``snapshot``'s weights
    (the warm start's when None)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astralight.tasks.facts import FactSource
    from astralight.tasks.warmstart import sample_completions

    model = AutoModelForCausalLM.from_pretrained(str(init), torch_dtype=torch.float32)
    if snapshot is not None:
        state = {n: t.float() for n, t in load_file(str(snapshot)).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"{snapshot}: missing {missing}, unexpected {unexpected}")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(init))
    src = FactSource("eval", **TABLE)
    prompts = [src.get(i) for i in range(len(src)) for _ in range(k)]
    with torch.no_grad():
        texts, _ = sample_completions(model, tokenizer, [p.prompt for p in prompts],
                                      max_new_tokens=4, temperature=1.0,
                                      generator=torch.Generator().manual_seed(seed))
    return sum(t.strip() == p.metadata["answer"] for t, p in zip(texts, prompts)) / len(prompts)


# ---------------------------------------------------------------------------------- astralight


def set_key(recipe: dict, dotted: str, value: str) -> None:
    """``recipe[a][b][0][c] = value`` (read as YAML) for ``dotted = "a.b.0.c"``."""
    import yaml

    parsed = yaml.safe_load(value)
    if isinstance(parsed, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    parts = dotted.split(".")
    node = recipe
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = parsed
    else:
        node[last] = parsed


def astra_recipe(budget_s: float, port: int, overrides: list[str]) -> dict:
    """The toy recipe with the facts task swapped in and a wall-clock stop."""
    import yaml

    recipe = copy.deepcopy(yaml.safe_load(TOY_RECIPE.read_text()))
    recipe["name"] = "vs-trl"
    recipe["port"] = port
    recipe["prepare"] = {"function": "astralight.tasks.facts.build_facts_policy",
                         "kwargs": {**TABLE, **WARM_START}}
    source = "astralight.tasks.facts.FactSource"
    recipe["dataflow"]["source"] = {"class_path": source, "init_args": {"split": "train", **TABLE}}
    recipe["dataflow"]["eval"]["source"] = {"class_path": source,
                                            "init_args": {"split": "eval", **TABLE}}
    recipe["stop"] = {"model_id": MODEL_ID, "max_wall_s": budget_s,
                      "timeout_s": budget_s + 600, "final_eval_timeout_s": 0,
                      "progress_every_s": 30}
    recipe["trainers"][0]["trainer"]["max_steps"] = 10**6
    for item in overrides:
        key, _, value = item.partition("=")
        set_key(recipe, key, value)
    return recipe


class _NoEngine:
    """What :class:`~astralight.raas.weight_sync.WeightSync` needs of an engine to only keep the
    shadow copy: a version."""

    version = -1


def run_astra(out: Path, init: Path, budget_s: float, n_points: int, overrides: list[str],
              log=print) -> dict:
    import yaml

    from astralight.dataflow.client import DataflowClient
    from astralight.raas.weight_sync import WeightSync

    run_dir = out / "astra_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "models").mkdir(parents=True)
    shutil.copytree(init, run_dir / "models" / "init")  # the shared warm start, reused
    port = _free_port()
    recipe_path = out / "astra_recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(astra_recipe(budget_s, port, overrides), sort_keys=False))
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
                row.update(samples=int(stats.get("samples_trained", 0)),
                           steps=int(stats.get("current_version", 0)))
            except Exception as exc:  # noqa: BLE001 - not up yet: the warm start stands
                row["error"] = f"{type(exc).__name__}: {exc}"
            if sync.state.version is not None:
                path = snaps / f"{i:03d}.safetensors"
                save_bf16(sync.state.tensors(), path)
                row.update(version=sync.state.version, snapshot=str(path))
            curve.append(row)
            log(f"[astra] t={at:.0f}s version {row['version']} samples {row['samples']}")
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
               seed: int = 0) -> None:
    """The TRL arm, in a process of its own: trains until the budget, keeping the weights at
    every eval point; writes ``trl_curve.json``."""
    t0 = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from astralight.tasks.facts import FactTable

    table = FactTable(**TABLE)
    rows = [{"prompt": table.prompt(k).prompt, "answer": table.answers[k]}
            for k in range(table.num_keys)]
    dataset = Dataset.from_list(rows * 50)  # epochs enough for any budget (the callback stops)

    def exact(completions, answer, **_):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    snaps = out / "trl_snaps"
    shutil.rmtree(snaps, ignore_errors=True)
    snaps.mkdir()
    times = points(budget_s, n_points)
    curve: list[dict] = []

    class WallClock(TrainerCallback):
        def __init__(self):
            self.next = 0

        def _keep(self, state, model) -> None:
            while self.next < len(times) and time.monotonic() - t0 >= times[self.next]:
                path = snaps / f"{self.next:03d}.safetensors"
                save_bf16(model.state_dict(), path)
                curve.append({"point": self.next, "t": times[self.next],
                              "at_s": round(time.monotonic() - t0, 2),
                              "steps": state.global_step,
                              "samples": state.global_step * 64, "snapshot": str(path)})
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
        output_dir=str(out / "trl_out"), learning_rate=lr, per_device_train_batch_size=64,
        num_generations=8, beta=0.0, temperature=1.0, max_completion_length=4,
        max_steps=10**6, logging_steps=10, save_strategy="no", report_to="none", use_cpu=True,
        bf16=False, seed=seed, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[exact], args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[WallClock()])
    trainer.train()
    (out / "trl_curve.json").write_text(json.dumps(curve))


def run_trl(out: Path, init: Path, budget_s: float, n_points: int, lr: float) -> dict:
    with open(out / "trl.log", "w") as log_file:
        code = subprocess.call([sys.executable, __file__, "--trl-worker", "--out-dir", str(out),
                                "--budget-s", str(budget_s), "--points", str(n_points),
                                "--trl-lr", str(lr)], stdout=log_file, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"the TRL arm exited {code}; see {out}/trl.log")
    return {"curve": json.loads((out / "trl_curve.json").read_text())}


# ---------------------------------------------------------------------------------- figures


def first_at(curve: list[dict], level: float) -> float | None:
    return next((r["t"] for r in curve if r["acc"] >= level), None)


def figures(astra: dict | None, trl: dict | None, load_before: list[float]) -> dict:
    """The printed figures; an arm that was not run (``None``, ``--arms``) has null figures
    and no curve, not the warm start's."""
    a = astra["curve"] if astra else None
    t = trl["curve"] if trl else None
    trl_best = max(r["acc"] for r in t) if t else None
    astra_to = first_at(a, trl_best) if a and t else None
    trl_to = first_at(t, trl_best) if t else None

    def last(curve, key):
        return curve[-1][key] if curve else None

    return {
        "astra_acc_at_budget": last(a, "acc"), "trl_acc_at_budget": last(t, "acc"),
        "warm_start_acc": (a or t)[0]["acc"] if (a or t) else None, "trl_best": trl_best,
        "astra_wall_to_trl_best": astra_to, "trl_wall_to_trl_best": trl_to,
        "ratio_wall_to_trl_best": (round(astra_to / trl_to, 3)
                                   if astra_to is not None and trl_to else None),
        "astra_samples": last(a, "samples"), "astra_steps": last(a, "steps"),
        "trl_samples": last(t, "samples"), "trl_steps": last(t, "steps"),
        "astra_curve": [(r["t"], r["acc"]) for r in a] if a else None,
        "trl_curve": [(r["t"], r["acc"]) for r in t] if t else None,
        "astra_summary": astra.get("summary") if astra else None,
        "load_before": load_before, "load_after": _load(),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, key in (("astralight", "astra_curve"), ("TRL GRPOTrainer", "trl_curve")):
        if not result[key]:  # an arm not run
            continue
        xs, ys = zip(*result[key])
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("wall time from the arm's start (s)")
    ax.set_ylabel("avg@4 on the unseen facts")
    ax.set_title("discovery task: time to accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=600.0)
    ap.add_argument("--points", type=int, default=10, help="eval points after the start")
    ap.add_argument("--trl-lr", type=float, default=3e-4)
    ap.add_argument("--astra-set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--arms", default="astra,trl", help="which arms to run (astra,trl)")
    ap.add_argument("--out-dir", type=Path, default=Path("runs/bench_vs_trl"))
    ap.add_argument("--png", type=Path, default=None, help="default: OUT_DIR/accuracy.png")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    arms = set(args.arms.split(","))
    if not arms or arms - {"astra", "trl"}:
        ap.error(f"--arms: a comma-separated list of astra and trl, got {args.arms!r}")
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    init = out / "init"
    if args.trl_worker:
        trl_worker(out, init, args.budget_s, args.points, args.trl_lr)
        return 0
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    load_before = _load()
    build_init(init)
    astra = trl = None
    if "astra" in arms:
        astra = run_astra(out, init, args.budget_s, args.points, args.astra_set, log)
        log(f"[bench] astra arm done; load {_load()}")
    if "trl" in arms:
        trl = run_trl(out, init, args.budget_s, args.points, args.trl_lr)
        log(f"[bench] trl arm done; load {_load()}")
    cache: dict = {}
    for arm in (a for a in (astra, trl) if a):
        for row in arm["curve"]:
            snap = row.get("snapshot")
            if snap not in cache:
                cache[snap] = evaluate(init, Path(snap) if snap else None)
            row["acc"] = cache[snap]
    result = {"bench": "vs_trl", "budget_s": args.budget_s, "trl_lr": args.trl_lr,
              "astra_set": args.astra_set, **figures(astra, trl, load_before)}
    plot(result, args.png or out / "accuracy.png")
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
