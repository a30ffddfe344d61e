"""``extends`` with list entries merged: a mapping laid over a parent's list changes the entries
it picks (an int key by index, a string key by model_id); a list still replaces, so the shipped
variants that restate lists resolve exactly as before."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from astralight.launch.recipe import RecipeError, deep_merge, entry_id, load_recipe, read_recipe_file

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "toy" / "recipe.yaml"
MULTI = ROOT / "examples" / "multi_agent" / "recipe.yaml"


def lists_replace(parent, child):
    """The merge rule before list entries could be merged (the reference for old recipes)."""
    if isinstance(parent, dict) and isinstance(child, dict):
        out = copy.deepcopy(parent)
        for key, value in child.items():
            out[key] = lists_replace(parent[key], value) if key in parent else copy.deepcopy(value)
        return out
    return copy.deepcopy(child)


def write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_mapping_over_a_list_merges_by_index_and_by_model_id():
    parent = {"raas": [{"a": 1, "b": {"c": 2}}, {"a": 3}],
              "trainers": [{"model": {"init_args": {"model_id": "solver", "lr": 1}}},
                           {"model": {"init_args": {"model_id": "verifier", "lr": 2}}, "x": [1]}]}
    child = {"raas": {1: {"a": 30}},
             "trainers": {"verifier": {"model": {"init_args": {"lr": 20}}, "x": [7, 8]}}}
    out = deep_merge(parent, child)
    assert out["raas"] == [{"a": 1, "b": {"c": 2}}, {"a": 30}]
    assert out["trainers"][0] == parent["trainers"][0]
    assert out["trainers"][1] == {"model": {"init_args": {"model_id": "verifier", "lr": 20}},
                                  "x": [7, 8]}  # inside an entry lists still replace
    assert parent["trainers"][1]["model"]["init_args"]["lr"] == 2  # inputs untouched
    assert deep_merge([1, 2], [3]) == [3] and deep_merge([{"a": 1}], {0: {"a": 2}}) == [{"a": 2}]


def test_entries_are_picked_by_their_model_id():
    assert entry_id({"model": {"init_args": {"model_id": "solver"}}}) == "solver"
    assert entry_id({"model_id": "x"}) == "x"
    assert entry_id({"engines": {}}) is None and entry_id(3) is None


@pytest.mark.parametrize("child, message", [
    ({"raas": {2: {"a": 1}}}, r"recipe\.raas\.2: the parent recipe's raas has 1 entry"),
    ({"trainers": {"critic": {}}}, r"recipe\.trainers\.critic: no entry .* model_id 'critic' "
                                   r"\(model_ids: \['policy'\]\)"),
    ({"raas": {"policy": {}}}, r"recipe\.raas\.policy: no entry"),
    ({"raas": {True: {}}}, r"recipe\.raas\.True: pick a list entry by index"),
])
def test_a_key_that_picks_nothing_is_named(child, message):
    parent = {"raas": [{"a": 1}], "trainers": [{"model": {"init_args": {"model_id": "policy"}}}]}
    with pytest.raises(RecipeError, match=message):
        deep_merge(parent, child)


def test_one_trainers_lr_changes_without_restating_the_list(tmp_path):
    path = write(tmp_path, "lr.yaml", {
        "extends": str(TOY), "trainers": {"policy": {"model": {"init_args": {"lr": 1.0e-4}}}}})
    merged, toy = load_recipe(path), load_recipe(TOY)
    assert merged["trainers"][0]["model"]["init_args"]["lr"] == 1.0e-4
    expected = copy.deepcopy(toy)
    expected["trainers"][0]["model"]["init_args"]["lr"] = 1.0e-4
    assert merged == expected  # nothing else changed


def test_the_multi_agent_verifier_alone_changes(tmp_path):
    path = write(tmp_path, "v.yaml", {
        "extends": str(MULTI),
        "trainers": {"verifier": {"model": {"init_args": {"lr": 3.0e-4}},
                                  "trainer": {"callbacks": {0: {"init_args": {"every_n_steps": 1}}}}}}})
    merged, base = load_recipe(path), load_recipe(MULTI)
    assert merged["trainers"][0] == base["trainers"][0]  # the solver
    verifier = merged["trainers"][1]
    assert verifier["model"]["init_args"]["lr"] == 3.0e-4
    assert verifier["model"]["init_args"]["model_id"] == "verifier"
    assert verifier["trainer"]["callbacks"][1:] == base["trainers"][1]["trainer"]["callbacks"][1:]


def test_raas_by_index_gives_the_autoscale_recipes_restated_list(tmp_path):
    """configs/toy/autoscale.yaml restates the toy's raas list to change four keys; merging
    raas[0] by index gives the same entry."""
    restated = load_recipe(ROOT / "configs" / "toy" / "autoscale.yaml")
    changes = {k: v for k, v in restated["raas"][0].items()
               if load_recipe(TOY)["raas"][0].get(k) != v}
    assert set(changes) == {"max_concurrency", "cycle_delay_s", "weight_check_interval_s",
                            "heartbeat_interval_s"}
    path = write(tmp_path, "a.yaml", {"extends": str(TOY), "raas": {0: changes}})
    assert load_recipe(path)["raas"] == restated["raas"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "toy" / "algorithms").glob("*.yaml"))
                         + [ROOT / "configs" / "toy" / "autoscale.yaml",
                            ROOT / "examples" / "multi_agent" / "solver_alone.yaml",
                            ROOT / "examples" / "custom_trainer" / "recipe.yaml"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_recipes_that_restate_lists_resolve_as_before(path):
    """Their child lists still replace the parent's: the resolved recipe is what the old rule
    (mappings merge, everything else replaces) gives."""
    raw = read_recipe_file(path)
    parent = read_recipe_file((path.parent / raw.pop("extends")).resolve())
    assert "extends" not in parent
    merged = load_recipe(path)
    merged.pop("pythonpath", None)  # made absolute when read (relative to the recipe's folder)
    raw.pop("pythonpath", None)
    assert merged == lists_replace(parent, raw)


def test_a_mapping_for_a_list_without_a_parent_is_named(tmp_path):
    recipe = yaml.safe_load(TOY.read_text())
    recipe["trainers"] = {"policy": {"model": {"init_args": {"lr": 1.0}}}}
    with pytest.raises(RecipeError, match=r"recipe\.trainers: a mapping .* only merges into the "
                                          r"list of a parent recipe"):
        load_recipe(write(tmp_path, "r.yaml", recipe))
