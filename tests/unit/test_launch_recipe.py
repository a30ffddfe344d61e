"""Recipe checks of the launcher: bad recipes fail before anything starts, naming the key."""

from __future__ import annotations

import pytest
import yaml

from astralight.launch import RecipeError, _default_recipe, _substitute, load_recipe


def write(tmp_path, recipe):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def toy():
    return yaml.safe_load(_default_recipe().read_text())


def test_embedded_default_recipe_is_valid():
    recipe = load_recipe(_default_recipe())
    trainer = recipe["trainers"][0]
    # the launcher's stop condition and the trainer's own must agree
    assert trainer["trainer"]["max_steps"] == recipe["stop"]["versions"]
    assert recipe["stop"]["versions"] % recipe["dataflow"]["eval"]["every"] == 0


@pytest.mark.parametrize("key", ["dataflow", "raas", "trainers", "stop"])
def test_missing_section_is_named(tmp_path, key):
    recipe = toy()
    del recipe[key]
    with pytest.raises(RecipeError, match=f"recipe.{key}"):
        load_recipe(write(tmp_path, recipe))


def test_final_version_must_be_evaluated(tmp_path):
    recipe = toy()
    recipe["stop"]["versions"] = recipe["dataflow"]["eval"]["every"] * 3 + 1
    with pytest.raises(RecipeError, match="multiple of dataflow.eval.every"):
        load_recipe(write(tmp_path, recipe))


def test_versions_must_be_positive(tmp_path):
    recipe = toy()
    recipe["stop"]["versions"] = 0
    with pytest.raises(RecipeError, match="recipe.stop.versions"):
        load_recipe(write(tmp_path, recipe))


def test_placeholders_substituted_everywhere():
    out = _substitute({"a": ["{run_dir}/x", {"b": "{init_model}"}], "n": 3},
                      {"run_dir": "/r", "init_model": "/m"})
    assert out == {"a": ["/r/x", {"b": "/m"}], "n": 3}
