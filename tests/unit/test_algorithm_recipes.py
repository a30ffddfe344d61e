"""configs/toy/algorithms/*.yaml: each recipe loads through the launcher, its dataflow section is a
valid DataflowConfig, and every data plugin it names is built, with the intended settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from astralight.dataflow.config import DataflowConfig, build_plugins
from astralight.launch import _default_recipe
from astralight.launch.recipe import load_recipe

ALGORITHMS = Path(__file__).resolve().parents[2] / "configs" / "toy" / "algorithms"
NAMES = ["vanilla", "dynamic_sampling", "ds_replay", "ds_replay_greso"]


def test_the_four_recipes_are_there():
    assert sorted(p.stem for p in ALGORITHMS.glob("*.yaml")) == sorted(NAMES)


def load_and_build(name):
    """Load a recipe, check what it shares with the toy recipe, build its plugins."""
    path = ALGORITHMS / f"{name}.yaml"
    assert f"astralight run configs/toy/algorithms/{name}.yaml" in path.read_text()  # header says how
    recipe = load_recipe(path)
    toy = load_recipe(_default_recipe())
    assert recipe["name"] != toy["name"]
    # same model, same seed, same prompt stream, same trainer as the toy recipe
    for key in ("prepare", "seed", "raas", "trainers"):
        assert recipe[key] == toy[key], key
    assert recipe["dataflow"]["source"] == toy["dataflow"]["source"]
    assert recipe["stop"]["versions"] == toy["stop"]["versions"]

    config = DataflowConfig(**recipe["dataflow"])
    plugins = build_plugins(config)
    assert len(plugins["curators"]) == len(config.curators)
    assert len(plugins["sample_filters"]) == len(config.sample_filters)
    assert len(plugins["replay.selectors"]) == len(config.replay.selectors)
    assert [len(v) for v in plugins["queue_order"].values()] == [1]  # the toy's edf, inherited
    return config, plugins


@pytest.mark.parametrize("name", NAMES)
def test_recipe_loads_and_every_plugin_builds(name):
    load_and_build(name)


def classes(objs):
    return [type(o).__name__ for o in objs]


def test_vanilla_is_the_toy_dataflow():
    config, plugins = load_and_build("vanilla")
    assert load_recipe(ALGORITHMS / "vanilla.yaml")["dataflow"] == load_recipe(_default_recipe())["dataflow"]
    assert plugins["curators"] == [] and plugins["sample_filters"] == []
    assert config.replay.ratio == 0.0


def test_dynamic_sampling_filters_zero_advantage_groups_without_replay():
    config, plugins = load_and_build("dynamic_sampling")
    assert classes(plugins["sample_filters"]) == ["ZeroAdvantage"]
    assert plugins["curators"] == [] and config.replay.ratio == 0.0


def test_ds_replay_settings():
    config, plugins = load_and_build("ds_replay")
    assert classes(plugins["sample_filters"]) == ["ZeroAdvantage"]
    assert (config.replay.ratio, config.replay.max_staleness, config.replay.pool_size) == (0.5, 4, 4096)
    assert classes(plugins["replay.selectors"]) == ["Uniform"]
    assert plugins["curators"] == []


def test_ds_replay_greso_uses_the_paper_settings():
    config, plugins = load_and_build("ds_replay_greso")
    assert classes(plugins["sample_filters"]) == ["ZeroAdvantage"]
    assert config.replay.ratio == 0.5 and classes(plugins["replay.selectors"]) == ["Uniform"]
    (greso,) = plugins["curators"]
    assert type(greso).__name__ == "GRESO"
    assert greso.p == pytest.approx({"easy": 0.5, "hard": 0.5})
    assert greso.alpha == pytest.approx({"easy": 0.083, "hard": 0.167})
    assert greso.floor == pytest.approx({"easy": 0.05, "hard": 0.30})
    assert greso.delta_p == pytest.approx(0.01) and greso.correct_threshold == pytest.approx(0.5)
