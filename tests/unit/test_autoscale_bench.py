"""The pure parts of tests/benchmarks/bench_autoscale.py: arguments, variant recipes, JSON rows.

The runs themselves need the whole system (the benchmark is run by hand); here each variant's
recipe is loaded through the launcher's checks and the result row is built from a summary.
"""

from __future__ import annotations

import json

import pytest
import yaml

from astralight.launch import build_components
from astralight.launch.recipe import load_recipe
from tests.benchmarks import bench_autoscale as bench


def args_of(*argv):
    args = bench.build_parser().parse_args(list(argv))
    bench.check_args(args)
    return args


def merged(tmp_path, recipe):
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return load_recipe(path)


def test_defaults_are_the_measured_setting():
    args = args_of()
    assert args.variants == ["fixed_small", "fixed_large", "autoscale"]
    assert (args.versions, args.small, args.large, args.batch_size) == (40, 1, 3, 1024)
    assert args.cycle_delay_s > 0 and args.max_concurrency == 16


@pytest.mark.parametrize("argv, flag", [(["--versions", "0"], "--versions"),
                                        (["--small", "3", "--large", "2"], "--small / --large"),
                                        (["--cycle-delay-s", "-1"], "--cycle-delay-s"),
                                        (["--every", "0"], "--every")])
def test_bad_arguments_name_the_flag(argv, flag):
    with pytest.raises(SystemExit, match=flag):
        args_of(*argv)


def test_variant_recipes_load_with_their_pools(tmp_path):
    args = args_of("--versions", "20", "--small", "1", "--large", "4", "--cycle-delay-s", "2")
    small = merged(tmp_path, bench.variant_recipe("fixed_small", args))
    large = merged(tmp_path, bench.variant_recipe("fixed_large", args))
    auto = merged(tmp_path, bench.variant_recipe("autoscale", args))
    for recipe in (small, large, auto):
        assert recipe["stop"]["versions"] == 20
        assert recipe["trainers"][0]["trainer"]["max_steps"] == 20
        assert recipe["dataflow"]["eval"]["every"] == 20  # evaluated at 0 and at the end
        assert recipe["dataflow"]["max_inflight_tasks"] == 4 * args.max_concurrency
        assert recipe["dataflow"]["max_buffered_samples"] >= 2 * args.batch_size
        assert recipe["cpu_affinity"]["raas"] == [1] and recipe["seed"] == 0  # same everywhere
        assert all(r["cycle_delay_s"] == 2.0 and r["max_concurrency"] == 16 for r in recipe["raas"])
    assert small["autoscale"] is None and len(small["raas"]) == 1
    assert large["autoscale"] is None and [r["seed"] for r in large["raas"]] == [0, 1, 2, 3]
    assert auto["autoscale"]["min_instances"] == 1 and auto["autoscale"]["max_instances"] == 4
    assert auto["autoscale"]["initial"] == 1 and len(auto["raas"]) == 1
    names = [c.name for c in build_components(large, tmp_path, "http://127.0.0.1:9", 9)]
    assert names == ["dataflow", "raas-0", "raas-1", "raas-2", "raas-3", "trainer-policy"]
    names = [c.name for c in build_components(auto, tmp_path, "http://127.0.0.1:9", 9)]
    assert names == ["dataflow", "autoscale", "trainer-policy"]


def test_result_row_json_shape():
    args = args_of()
    summary = {"versions": 30, "rollout_capacity_seconds": 300.0, "trainer_seconds": 120.0,
               "eval_accuracy_end": 0.41, "rollouts_generated": 9000,
               "counters": {"stale_dropped": 12},
               "per_version": {"0": {"trainer_wait_ms": 500, "trainer_step_ms": 1000},
                               "1": {"trainer_wait_ms": 100, "trainer_step_ms": 1000}},
               "pool": [{"version": 0, "action": "initial", "pool": 0, "target": 1},
                        {"version": 5, "action": "scale_up", "pool": 1, "target": 3},
                        {"version": 30, "action": "shutdown", "pool": 3, "target": 0}]}
    row = bench.result_row("autoscale", args, summary, 200.04, s_per_version=3.21)
    for key in ("wall_s", "rollout_capacity_seconds", "trainer_seconds", "total_capacity_seconds",
                "wait_fraction", "final_eval_accuracy"):
        assert key in row
    assert row["total_capacity_seconds"] == 420.0 and row["wait_fraction"] == 0.3
    assert row["wall_s"] == 200.0 and row["largest_pool"] == 3 and row["seconds_per_version"] == 3.21
    assert [d["action"] for d in row["decisions"]] == ["initial", "scale_up", "shutdown"]
    assert json.loads(json.dumps(row)) == row
    fixed = bench.result_row("fixed_large", args, {"versions": 30}, 1.0)
    assert fixed["largest_pool"] == 3 and fixed["total_capacity_seconds"] is None
    assert "decisions" not in fixed and fixed["wait_fraction"] is None
    assert "autoscale" in bench.format_table([row, fixed])


def test_print_recipes_runs_nothing(capsys):
    assert bench.main(["--print-recipes", "--variants", "autoscale", "fixed_small"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["variant"] for x in lines] == ["fixed_small", "autoscale"]  # canonical order
