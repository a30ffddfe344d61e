"""The discovery task (astralight/tasks/facts.py) and the pure parts of
tests/benchmarks/bench_vs_trl.py (its recipe, its figures); the bench's runs need the whole
system and TRL, and are run by hand."""

from __future__ import annotations

import json

import pytest
import yaml

from astralight.launch.recipe import load_recipe
from astralight.launch.recipe_schema import validate_recipe
from astralight.tasks.facts import FactSource, FactTable, build_facts_policy
from astralight.tasks.sft_warmstart import read_pairs
from tests.benchmarks import bench_vs_trl as bench


def test_the_table_is_seeded_and_splits_keys_into_seen_and_unseen():
    table = FactTable(num_keys=200, seen_share=0.25, seed=0)
    again = FactTable(num_keys=200, seen_share=0.25, seed=0)
    assert table.answers == again.answers and table.seen == again.seen
    assert FactTable(num_keys=200, seed=1).answers != table.answers
    assert len(table.seen) == 50 and len(table.unseen) == 150
    assert set(table.seen).isdisjoint(table.unseen)
    assert set(table.seen) | set(table.unseen) == set(range(200))
    assert all(len(a) == 1 and a.isdigit() for a in table.answers)
    assert len(set(table.answers)) > 5  # arbitrary facts, not one answer
    p = table.prompt(7)
    assert p.prompt == "f007=" and p.metadata == {"answer": table.answers[7]}


def test_eval_is_the_unseen_facts_and_train_draws_every_key(tmp_path):
    table = FactTable()
    ev = FactSource("eval")
    assert len(ev) == 150 and [ev.get(i).prompt for i in range(3)] == [
        table.prompt(k).prompt for k in table.unseen[:3]]
    with pytest.raises(IndexError):
        ev.get(150)
    assert len(FactSource("eval", eval_size=10)) == 10
    train = FactSource("train")
    drawn = {train.get(i).prompt for i in range(3000)}
    assert drawn == {table.prompt(k).prompt for k in range(200)}
    assert train.get(5) == FactSource("train").get(5)  # get(i) depends on (seed, i) alone
    pairs = read_pairs(table.write_pairs(tmp_path / "seen.jsonl"))
    assert pairs == [(table.prompt(k).prompt, table.answers[k]) for k in table.seen]


@pytest.mark.parametrize("kwargs, field", [({"num_keys": 1}, "num_keys"),
                                           ({"seen_share": 1.0}, "seen_share"),
                                           ({"answer_len": 0}, "answer_len"),
                                           ({"alphabet": "aa"}, "alphabet")])
def test_bad_table_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FactTable(**kwargs)
    with pytest.raises(ValueError, match="split"):
        FactSource("test")


def test_the_warm_start_needs_a_seen_fact_and_declares_its_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="seen_share"):
        build_facts_policy(tmp_path / "m", seen_share=0.0)
    assert not (tmp_path / "m").exists()
    assert build_facts_policy.vocab_size() == 96


def test_the_bench_recipe_is_the_toy_with_the_task_swapped_in_and_loads(tmp_path):
    toy_lr = yaml.safe_load(bench.TOY_RECIPE.read_text())["trainers"][0]["model"]["init_args"]["lr"]
    assert toy_lr != 1e-3  # so that the override below shows
    recipe = bench.astra_recipe(600, 8765, ["trainers.0.model.init_args.lr=1e-3",
                                             "dataflow.group_size=16"])
    validate_recipe(recipe)
    toy = yaml.safe_load(bench.TOY_RECIPE.read_text())
    assert recipe["raas"] == toy["raas"] and recipe["cpu_affinity"] == toy["cpu_affinity"]
    assert recipe["dataflow"]["source"]["class_path"] == "astralight.tasks.facts.FactSource"
    assert recipe["dataflow"]["eval"]["source"]["init_args"]["split"] == "eval"
    assert recipe["prepare"]["function"] == "astralight.tasks.facts.build_facts_policy"
    assert recipe["stop"]["max_wall_s"] == 600 and recipe["port"] == 8765
    assert recipe["trainers"][0]["model"]["init_args"]["lr"] == 1e-3
    assert recipe["dataflow"]["group_size"] == 16
    assert toy["trainers"][0]["model"]["init_args"]["lr"] == toy_lr  # the toy's file untouched
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    loaded = load_recipe(path)
    assert loaded["stop"]["max_wall_s"] == 600


def _curve(accs, budget=600):
    n = len(accs) - 1
    return {"curve": [{"t": budget * i / n, "acc": a, "samples": 100 * i, "steps": i}
                      for i, a in enumerate(accs)]}


def test_figures_time_astralight_to_trls_best():
    out = bench.figures(_curve([0.1, 0.5, 0.7, 0.7]), _curve([0.1, 0.3, 0.6, 0.65]), [1.0])
    assert out["trl_best"] == 0.65 and out["trl_wall_to_trl_best"] == 600
    assert out["astra_wall_to_trl_best"] == 400 and out["ratio_wall_to_trl_best"] == 0.667
    assert out["astra_acc_at_budget"] == 0.7 and out["trl_acc_at_budget"] == 0.65
    assert out["astra_steps"] == 3 and out["trl_samples"] == 300
    never = bench.figures(_curve([0.1, 0.1, 0.2, 0.3]), _curve([0.1, 0.3, 0.6, 0.65]), [1.0])
    assert never["astra_wall_to_trl_best"] is None and never["ratio_wall_to_trl_best"] is None
    json.dumps(out)
    assert bench.points(600, 3) == [0, 200, 400, 600]


def test_an_arm_not_run_has_null_figures_not_the_warm_starts():
    alone = bench.figures(_curve([0.1, 0.5, 0.7, 0.7]), None, [1.0])
    assert alone["astra_acc_at_budget"] == 0.7 and alone["astra_samples"] == 300
    assert alone["warm_start_acc"] == 0.1
    for key in ("trl_acc_at_budget", "trl_best", "trl_wall_to_trl_best", "astra_wall_to_trl_best",
                "ratio_wall_to_trl_best", "trl_samples", "trl_steps", "trl_curve"):
        assert alone[key] is None, key
    trl_only = bench.figures(None, _curve([0.1, 0.3, 0.6, 0.65]), [1.0])
    assert trl_only["trl_best"] == 0.65 and trl_only["trl_wall_to_trl_best"] == 600
    assert trl_only["astra_acc_at_budget"] is None and trl_only["astra_curve"] is None
    json.dumps(alone)


def test_arms_must_name_astra_or_trl(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--arms", "astra,trll", "--out-dir", str(tmp_path / "out")])
    assert exc.value.code == 2 and "--arms" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
