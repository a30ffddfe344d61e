"""The pure parts of tests/benchmarks/bench_examples_learn.py: each run's recipe (seed,
precision, length, overrides on the example's own recipe), the goals per run and the summary per
cell. Its runs start the whole system and are run by hand."""

from __future__ import annotations

import json

import pytest

from astralight.launch.recipe_schema import validate_recipe
from tests.benchmarks import bench_examples_learn as bench


@pytest.mark.parametrize("name", bench.LEARNING_EXAMPLES)
def test_a_run_changes_only_the_seed_precision_length_and_overrides(name):
    base = bench.example_recipe(name)
    recipe = bench.run_recipe(base, 7, "bfloat16", 12, ["trainers.0.model.init_args.lr=3e-4"])
    validate_recipe(recipe)
    assert recipe["seed"] == 7 and base["seed"] != 7
    assert all(t["seed_everything"] == 7 for t in recipe["trainers"])
    assert all(r["seed"] == 7 for r in recipe["raas"])
    assert {e["dtype"] for r in recipe["raas"] for e in r["engines"].values()} == {"bfloat16"}
    assert recipe["stop"]["versions"] == 12
    assert all(t["trainer"]["max_steps"] == 12 * bench._publisher_every(t) for t in recipe["trainers"])
    assert 12 % recipe["dataflow"]["eval"]["every"] == 0  # the last version is evaluated
    assert recipe["trainers"][0]["model"]["init_args"]["lr"] == 3e-4
    assert recipe["prepare"] == base["prepare"]  # one warm start per example, shared by seeds
    assert recipe["dataflow"]["source"] == base["dataflow"]["source"]


def test_bad_arguments_are_named():
    base = bench.example_recipe("toy")
    with pytest.raises(SystemExit, match="--set lr: expected KEY=VALUE"):
        bench.run_recipe(base, 0, None, None, ["lr"])
    with pytest.raises(SystemExit, match="--versions: must be >= 1"):
        bench.run_recipe(base, 0, None, 0, [])
    with pytest.raises(SystemExit, match="--examples: 'nope' has no examples/nope/recipe.yaml"):
        bench.example_recipe("nope")


def test_goals_per_run():
    ok = {"eval_accuracy_start": 0.17, "eval_accuracy_best": 0.59, "eval_accuracy_end": 0.58}
    fell = {"eval_accuracy_start": 0.16, "eval_accuracy_best": 0.57, "eval_accuracy_end": 0.0}
    assert bench.goal_met("tool_use", ok) == {"end_at_least": True, "hold": True, "rose": True}
    assert bench.goal_met("tool_use", fell) == {"end_at_least": False, "hold": False, "rose": False}
    assert bench.goal_met("toy", {"eval_accuracy_start": 0.2})["end_at_least"] is None  # no eval
    # smollm2_math: 15 points up within 30 minutes
    rose = {"eval_accuracy_start": 0.2, "eval_accuracy_best": 0.6, "eval_accuracy_end": 0.56,
            "wall_s": 1500}
    assert bench.goal_met("smollm2_math", rose) == {"rise_at_least": True, "within_s": True,
                                                    "hold": True, "rose": True}
    late = {**rose, "eval_accuracy_end": 0.3, "wall_s": 1900}
    assert bench.goal_met("smollm2_math", late) == {"rise_at_least": False, "within_s": False,
                                                    "hold": False, "rose": True}
    # the tool variant (an example's other recipe, NAME/VARIANT): the tool-call rate must rise too
    calls = {**rose, "tool_call_rate_start": 0.34, "tool_call_rate_end": 1.0}
    assert bench.goal_met("smollm2_math/tools", calls) == {
        "rise_at_least": True, "tool_calls_rise": True, "hold": True, "rose": True}
    assert bench.goal_met("smollm2_math/tools", {**calls, "tool_call_rate_end": 0.2})[
        "tool_calls_rise"] is False


def test_a_variant_names_an_examples_other_recipe():
    assert bench.example_path("toy").name == "recipe.yaml"
    assert bench.example_path("smollm2_math/tools") == bench.EXAMPLES / "smollm2_math" / "tools.yaml"
    assert bench.example_recipe("smollm2_math/tools")["name"] == "smollm2_tools"
    with pytest.raises(SystemExit, match="or NAME/VARIANT for examples/NAME/VARIANT.yaml"):
        bench.example_recipe("smollm2_math/nope")


def test_the_summary_holds_every_seed_of_a_cell_and_fails_a_goal_if_one_seed_does():
    rows = [{"example": "tool_use", "dtype": "float32", "condition": c, "seed": s, "exit_code": 0,
             "eval_accuracy_end": end, "goals": {"hold": end > 0.5}, "warnings": w}
            for c, s, end, w in [("quiet", 0, 0.58, []), ("quiet", 1, 0.6, []),
                                 ("contended", 0, 0.59, []), ("contended", 1, 0.0, ["reward_drop (policy)"])]]
    cells = {c["condition"]: c for c in bench.summarize(rows)}
    assert cells["quiet"]["goals_met"] == {"hold": True} and cells["quiet"]["seeds"] == [0, 1]
    assert cells["contended"]["goals_met"] == {"hold": False}
    assert cells["contended"]["eval_accuracy_end"] == {"mean": 0.295, "min": 0.0, "max": 0.59, "n": 2}
    assert cells["contended"]["warnings"] == ["reward_drop (policy)"]


def test_plot_from_earlier_rows(tmp_path):
    rows = [{"example": "smollm2_math", "dtype": "auto", "condition": "quiet", "seed": s,
             "wall_s": 1500.0, "eval": {"0": 0.2, "5": 0.3 + s / 10, "10": 0.6}} for s in range(2)]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"summary": []}\n')
    png = tmp_path / "curve.png"
    assert bench.main(["--plot-from", str(jsonl), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="--plot-from: needs --png"):
        bench.main(["--plot-from", str(jsonl)])
    with pytest.raises(SystemExit, match="no run has an eval curve"):
        bench.plot([{**rows[0], "eval": {}}], png)


def test_the_warm_start_is_built_with_the_overrides_at_the_recipes_own_seed():
    base = bench.example_recipe("search_agent")
    recipe = bench.prepare_recipe(base, ["prepare.kwargs.sft_steps=1200"])
    kwargs, base_kwargs = recipe["prepare"]["kwargs"], base["prepare"]["kwargs"]
    assert kwargs["sft_steps"] == 1200 != base_kwargs["sft_steps"]
    assert recipe["seed"] == base["seed"] and kwargs["seed"] == base_kwargs["seed"]


def test_window_means_reads_reward_malformed_share_and_invalid_commands(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tensorboard" / "policy" / "version_0"))
    for step, (reward, invalid) in enumerate([(0.0, 3.0), (0.5, 2.0), (1.0, 1.0), (1.0, 0.0)]):
        writer.add_scalar("train/reward_mean", reward, step)
        writer.add_scalar("agent/invalid_actions", invalid, step)
    writer.close()
    [means] = bench.window_means(tmp_path, 2).values()
    assert means["train_reward_first"] == 0.25 and means["train_reward_last"] == 1.0
    assert means["invalid_actions_first"] == 2.5 and means["invalid_actions_last"] == 0.5
    assert means["malformed_share_first"] is None and means["steps"] == 4
