"""The pure parts of tests/benchmarks/bench_data_algorithms.py: variants, recipes, curves, output.

The runs themselves need the whole system (the benchmark is run by hand); here every variant's
recipe is checked to load through the launcher with the intended settings.
"""

from __future__ import annotations

import json

import pytest
import yaml

from astralight.launch.recipe import load_recipe
from tests.benchmarks import bench_data_algorithms as bench


def write(tmp_path, recipe, name="variant.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_variants_cover_the_issue_and_select_in_canonical_order():
    names = [v.name for v in bench.select_variants(None)]
    assert names == ["vanilla", "ds", "ds_replay_0.3", "ds_replay_0.5", "ds_replay_0.7",
                     "ds_replay_greso_0.3", "ds_replay_greso_0.5"]
    picked = bench.select_variants(["ds_replay_greso_0.5", "vanilla"])
    assert [v.name for v in picked] == ["vanilla", "ds_replay_greso_0.5"]
    with pytest.raises(SystemExit, match="unknown.*'nope'"):
        bench.select_variants(["nope"])


@pytest.mark.parametrize("variant", bench.VARIANTS, ids=lambda v: v.name)
def test_each_variant_recipe_loads_with_its_algorithm(tmp_path, variant):
    recipe = bench.variant_recipe(variant, None)
    assert set(recipe) <= {"extends", "name", "dataflow"}  # default versions: nothing restated
    merged = load_recipe(write(tmp_path, recipe))
    dataflow = merged["dataflow"]
    assert merged["name"] == f"bench-{variant.name}"
    assert merged["stop"]["versions"] == 150
    if variant.name == "vanilla":
        assert not dataflow.get("sample_filters") and "replay" not in dataflow
    else:
        assert dataflow["sample_filters"] == ["zero_advantage"]
    if variant.replay_ratio:
        assert dataflow["replay"]["ratio"] == variant.replay_ratio
        assert dataflow["replay"]["max_staleness"] == 4  # the rest of replay is inherited
    else:
        assert dataflow.get("replay", {}).get("ratio", 0.0) == 0.0
    greso = [c for c in dataflow.get("curators", []) if c["class_path"] == "greso"]
    assert bool(greso) == ("greso" in variant.name)


def test_versions_set_stop_max_steps_and_a_dividing_eval_period(tmp_path):
    variant = bench.select_variants(["ds_replay_0.5"])[0]
    for versions, every in ((10, 10), (15, 5), (7, 7), (300, 10)):
        recipe = bench.variant_recipe(variant, versions)
        merged = load_recipe(write(tmp_path, recipe))  # the launcher's checks pass
        assert merged["stop"]["versions"] == versions
        assert merged["trainers"][0]["trainer"]["max_steps"] == versions
        assert merged["dataflow"]["eval"]["every"] == every
        assert merged["dataflow"]["eval"]["k"] == 4  # eval settings otherwise inherited
        assert merged["dataflow"]["replay"]["ratio"] == 0.5
    assert load_recipe(write(tmp_path, bench.variant_recipe(variant, 300)))["stop"]["timeout_s"] == 3600


def test_eval_period_divides_versions():
    assert bench.eval_every_for(150, 10) == 10
    assert bench.eval_every_for(12, 10) == 6
    assert bench.eval_every_for(13, 10) == 1
    assert bench.eval_every_for(4, 10) == 4


SUMMARY = {  # as summary.json holds it: JSON string keys
    "eval_accuracy_end": 0.75, "samples_trained": 768, "rollouts_generated": 1000, "versions": 3,
    "eval": {"0": {"avg_at_k": 0.25}, "2": {"avg_at_k": 0.5}, "3": {"avg_at_k": 0.75}},
    "per_version": {"0": {"rollouts_generated": 300}, "1": {"rollouts_generated": 200},
                    "2": {"rollouts_generated": 400}, "3": {"rollouts_generated": 100}},
    "counters": {"groups_filtered": 12, "prompts_skipped": 5, "replay_served": 40},
}


def test_curve_is_cumulative_rollouts_before_each_evaluated_version():
    assert bench.eval_curve(SUMMARY) == [[0, 0.25], [500, 0.5], [900, 0.75]]
    assert bench.eval_curve({**SUMMARY, "per_version": None}) is None
    # a version with no counters (nothing arrived while it was current) adds nothing
    sparse = {**SUMMARY, "per_version": {"1": {"rollouts_generated": 64}}}
    assert bench.eval_curve(sparse) == [[0, 0.25], [64, 0.5], [64, 0.75]]


def test_rollouts_to_reach():
    curve = [[0, 0.25], [500, 0.5], [900, 0.75]]
    assert bench.rollouts_to_reach(curve, 0.5) == 500
    assert bench.rollouts_to_reach(curve, 0.8) is None
    assert bench.rollouts_to_reach(None, 0.5) is None


def test_result_row_json_line_and_table():
    variant = bench.select_variants(["ds_replay_0.3"])[0]
    row = bench.result_row(variant, SUMMARY, wall_s=12.34)
    line = bench.json_line(row)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["variant"] == "ds_replay_0.3" and parsed["replay_ratio"] == 0.3
    assert parsed["rollouts_generated"] == 1000 and parsed["samples_trained"] == 768
    assert parsed["final_eval_accuracy"] == 0.75 and parsed["wall_s"] == 12.3
    assert parsed["curve"] == [[0, 0.25], [500, 0.5], [900, 0.75]]
    assert parsed["groups_filtered"] == 12 and parsed["prompts_skipped"] == 5
    table = bench.format_table([row, bench.result_row(bench.VARIANTS[0], {}, 1.0)])
    assert "ds_replay_0.3" in table and "vanilla" in table and "0.750" in table


def test_plot_writes_a_png(tmp_path):
    rows = [bench.result_row(v, SUMMARY, 1.0) for v in bench.VARIANTS[:2]]
    out = bench.plot(rows, tmp_path / "fig" / "out.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
