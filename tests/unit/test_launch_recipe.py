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


def test_committed_toy_component_configs_match_the_recipe(tmp_path):
    """configs/toy/ (README: starting each component on its own) is the recipe, exported."""
    from pathlib import Path

    from astralight.launch import export_configs

    committed = Path(__file__).resolve().parents[2] / "configs" / "toy"
    written = export_configs(_default_recipe(), tmp_path)
    assert sorted(p.name for p in written) == ["dataflow.yaml", "raas.yaml", "trainer.yaml"]
    for path in written:
        assert yaml.safe_load(path.read_text()) == yaml.safe_load((committed / path.name).read_text()), (
            f"configs/toy/{path.name} is out of date: run `astralight run --export-configs configs/toy`")


def test_exported_trainer_config_parses_with_lightning_cli(tmp_path):
    """The trainer config is a valid LightningCLI config for `astralight fit` (no fit is run)."""
    import subprocess
    import sys

    from astralight.launch import export_configs

    export_configs(_default_recipe(), tmp_path)
    out = subprocess.run([sys.executable, "-m", "astralight.cli", "fit", "--config",
                          str(tmp_path / "trainer.yaml"), "--print_config"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = yaml.safe_load(out.stdout)
    assert printed["model"]["class_path"] == "astralight.policy.M2POPolicy"
    assert printed["trainer"]["max_steps"] == yaml.safe_load(_default_recipe().read_text())["stop"]["versions"]
