"""The launcher's ``autoscale:`` recipe key: checks, the components it starts, the summary fields."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from astralight.autoscale.service import build_parser, check_args
from astralight.launch import build_components
from astralight.launch.recipe import RecipeError, autoscale_settings, load_recipe
from astralight.launch.summary import read_pool_history, rollout_capacity_seconds

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "toy" / "autoscale.yaml"


def test_toy_autoscale_recipe_loads_and_extends_the_toy():
    recipe = load_recipe(RECIPE)
    assert recipe["autoscale"]["min_instances"] == 1 and recipe["autoscale"]["max_instances"] == 3
    assert recipe["raas"][0]["cycle_delay_s"] > 0 and recipe["raas"][0]["max_concurrency"] == 16
    assert recipe["trainers"][0]["trainer"]["max_steps"] == recipe["stop"]["versions"]
    assert recipe["cpu_affinity"]["raas"] == [1]  # inherited


def test_autoscale_replaces_the_fixed_raas_list_with_the_autoscaler(tmp_path):
    recipe = load_recipe(RECIPE)
    recipe["raas"].append(dict(recipe["raas"][0], seed=1))  # ignored: raas[0] is the template
    comps = build_components(recipe, tmp_path, "http://127.0.0.1:9", 9)
    assert [c.name for c in comps] == ["dataflow", "autoscale", "trainer-policy"]
    auto = comps[1]
    argv = auto.argv[auto.argv.index("autoscale") + 1:]
    args = build_parser().parse_args(argv)
    assert check_args(args) is None  # the autoscaler accepts what the launcher passes
    assert (args.min, args.max, args.initial, args.every, args.cooldown_s) == (1, 3, 1, 5, 30.0)
    assert args.dataflow == "http://127.0.0.1:9" and args.model_id == "policy"
    assert args.backend == "local" and args.log_dir == str(tmp_path / "logs")
    assert args.decisions_log == str(tmp_path / "autoscale.jsonl")
    assert yaml.safe_load(Path(args.raas_config).read_text()) == recipe["raas"][0]
    assert auto.log_path == tmp_path / "logs" / "autoscale.log"
    if len(os.sched_getaffinity(0)) > 1 and {0, 1} <= os.sched_getaffinity(0):
        # pinned to the RaaS core, which its instances inherit, with vLLM told so
        assert auto.cpus == [1] and auto.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_without_autoscale_the_fixed_pool_is_started(tmp_path):
    recipe = load_recipe(RECIPE)
    recipe["autoscale"] = None  # what a variant's `autoscale: null` merges to
    comps = build_components(recipe, tmp_path, "http://127.0.0.1:9", 9)
    assert [c.name for c in comps] == ["dataflow", "raas-0", "trainer-policy"]


@pytest.mark.parametrize("spec, key", [
    ({"max_instances": 0}, "max_instances"),
    ({"min_instances": 3, "max_instances": 2}, "max_instances"),
    ({"min_instances": -1}, "min_instances"),
    ({"initial": 5, "max_instances": 3}, "initial"),
    ({"every": 0}, "every"),
    ({"cooldown_s": -1}, "cooldown_s"),
    ({"poll_s": 0}, "poll_s"),
    ({"max_instance": 3}, "max_instance"),
    ({"every": "5"}, "every"),
])
def test_bad_autoscale_settings_name_the_key(tmp_path, spec, key):
    recipe = {"extends": str(RECIPE), "autoscale": spec}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match=rf"recipe\.autoscale\.{key}"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"recipe\.autoscale: must be a mapping"):
        autoscale_settings([1, 3])


def test_rollout_capacity_seconds_sums_alive_times_capacity():
    rows = [{"instance_id": "a", "alive_s": 100.0, "capacity_units": 1.0},
            {"instance_id": "b", "alive_s": 40.0, "capacity_units": 2.0},
            {"instance_id": "c", "alive_s": 10.0}]  # capacity_units defaults to 1
    assert rollout_capacity_seconds(rows) == 190.0
    assert rollout_capacity_seconds([{"instance_id": "old"}]) is None  # table without alive_s
    assert rollout_capacity_seconds([]) is None


def test_pool_history_from_the_decisions_log(tmp_path):
    path = tmp_path / "autoscale.jsonl"
    assert read_pool_history(path) is None
    entries = [{"time": 1.0, "version": 0, "action": "initial", "pool": 0, "target": 1,
                "launch": 1, "launched": ["auto-0"], "retire": [], "reason": "initial pool",
                "errors": [], "report": None},
               {"time": 9.0, "version": 5, "action": "scale_up", "pool": 1, "target": 3,
                "launched": ["auto-1", "auto-2"], "retire": [], "reason": "waited",
                "errors": [], "report": {"wait_fraction": 0.5}}]
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + "not json\n")
    history = read_pool_history(path)
    assert [(h["action"], h["pool"], h["target"]) for h in history] == [("initial", 0, 1),
                                                                        ("scale_up", 1, 3)]
    assert history[1]["launched"] == ["auto-1", "auto-2"] and "report" not in history[1]
