"""examples/multi_agent/recipe.yaml and the async-vs-sync bench's variants are valid configs:
the dataflow config and its plugins build, the RaaS config (two engines, the solver-verifier
workflow, wrapped in the latency profile for the bench) parses, one trainer per policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from astralight.dataflow.config import DataflowConfig, build_plugins
from astralight.launch import component_configs
from astralight.raas.config import build_parser
from astralight.launch.recipe import load_recipe
from astralight.workflows.latency import LongTailLatency
from astralight.workflows.solver_verifier import SolverVerifier
from tests.benchmarks.bench_async_vs_sync import mode_recipe, seconds_per_version

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "multi_agent" / "recipe.yaml"


def _raas_workflow(raas_cfg: dict):
    parser = build_parser()
    cfg = parser.parse_object({k: v for k, v in raas_cfg.items() if k != "engines"}
                              | {"engines": {}})
    return parser.instantiate_classes(cfg).workflow


def test_multi_agent_recipe_has_two_policies_and_their_trainers():
    recipe = load_recipe(RECIPE)
    df = DataflowConfig(**recipe["dataflow"])
    build_plugins(df)
    assert df.model_ids == ["solver", "verifier"] and df.workflow == "solver_verifier"
    assert sorted(recipe["raas"][0]["engines"]) == ["solver", "verifier"]
    assert [t["model"]["init_args"]["model_id"] for t in recipe["trainers"]] == ["solver", "verifier"]
    # each datamodule pulls its own policy: its model_id is linked to the module's (stated once)
    assert all("model_id" not in t["data"]["init_args"] for t in recipe["trainers"])
    wf = _raas_workflow(recipe["raas"][0])
    assert isinstance(wf, SolverVerifier) and wf.roles == {"solver": "solver", "verifier": "verifier"}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bench_modes_differ_only_in_the_dataflow_mode(tmp_path, mode):
    recipe = mode_recipe(mode, versions=6, batch_size=64, median_s=0.3, sigma=1.5, cap_s=10.0,
                         staleness=4)
    path = tmp_path / "r.yaml"
    import yaml

    path.write_text(yaml.safe_dump(recipe))
    merged = load_recipe(path)
    df = DataflowConfig(**merged["dataflow"])
    assert df.mode == mode and (df.sync_batch_size == 64) == (mode == "sync")
    assert df.max_staleness == (0 if mode == "sync" else 4)
    assert all(t["data"]["init_args"]["batch_size"] == 64 for t in merged["trainers"])
    assert all(t["trainer"]["max_steps"] == 6 for t in merged["trainers"])
    raas = merged["raas"][0]
    assert "concurrent_cycles" not in raas  # every task is its own episode
    wf = _raas_workflow(raas)
    assert isinstance(wf, LongTailLatency) and isinstance(wf.inner, SolverVerifier)
    assert wf.name == "solver_verifier"
    assert set(component_configs(merged, tmp_path, 8400)) >= {
        "dataflow", "raas-0", "trainer-solver", "trainer-verifier"}


def test_seconds_per_version_is_the_slower_policys():
    times = {"solver": {1: 10.0, 5: 18.0}, "verifier": {1: 10.0, 5: 30.0}}
    assert seconds_per_version(times) == 5.0
    assert seconds_per_version({"solver": {3: 1.0}}) is None
