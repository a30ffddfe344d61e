"""The recipe's typed schema (astralight.launch.recipe_schema): unknown keys and bad values are refused
naming the key (and the closest valid one); every shipped recipe still loads; the schema declares
every key the launcher reads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from astralight.launch.recipe import AUTOSCALE_DEFAULTS, RecipeError, load_recipe
from astralight.launch.recipe_schema import (
    AutoscaleSection,
    Recipe,
    SchemaError,
    StopSection,
    SuperviseSection,
    validate_recipe,
)

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "toy" / "recipe.yaml"
#: every recipe the repository ships (component configs are the other YAML files)
SHIPPED = sorted(
    [p for p in (ROOT / "examples").glob("**/*.yaml")
     if "cluster" not in p.relative_to(ROOT / "examples").parts  # Kubernetes manifests
     and ("trainers" in (yaml.safe_load(p.read_text()) or {})
     or "extends" in (yaml.safe_load(p.read_text()) or {}))]
    + sorted((ROOT / "configs" / "toy" / "algorithms").glob("*.yaml"))
    + [ROOT / "configs" / "toy" / "autoscale.yaml"])


def child(tmp_path: Path, **changes) -> Path:
    """A recipe extending the toy recipe with ``changes``."""
    path = tmp_path / "child.yaml"
    path.write_text(yaml.safe_dump({"extends": str(TOY), **changes}))
    return path


def test_the_shipped_recipes_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SHIPPED}
    assert {"examples/toy/recipe.yaml", "examples/multi_agent/solver_alone.yaml",
            "examples/agents/verifiers/recipe.yaml", "configs/toy/autoscale.yaml",
            "configs/toy/algorithms/vanilla.yaml"} <= names
    assert not any(n.endswith("trainer.yaml") for n in names)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    validate_recipe(recipe)  # load_recipe did; the merged recipe fits the schema as it is
    assert recipe["trainers"] and recipe["raas"]


@pytest.mark.parametrize("key, closest", [("supervize", "supervise"),
                                          ("cpu_afinity", "cpu_affinity"),
                                          ("pythonpaht", "pythonpath")])
def test_an_unknown_top_level_key_is_named_with_the_closest_valid_one(tmp_path, key, closest):
    with pytest.raises(RecipeError, match=rf"recipe\.{key}: unknown key; did you mean "
                                          rf"'{closest}'\?"):
        load_recipe(child(tmp_path, **{key: {}}))


def test_a_duration_with_units_is_refused_naming_the_key(tmp_path):
    with pytest.raises(RecipeError, match=r"recipe\.stop\.timeout_s: .*'15m'.*expected: seconds"):
        load_recipe(child(tmp_path, stop={"timeout_s": "15m"}))


@pytest.mark.parametrize("changes, message", [
    ({"stop": {"timeout": 900}}, r"recipe\.stop\.timeout: unknown key; did you mean 'timeout_s'"),
    ({"prepare": {"functoin": "x"}}, r"recipe\.prepare\.functoin: unknown key; did you mean "
                                     r"'function'"),
    ({"supervise": {"max_restarts": "three"}}, r"recipe\.supervise\.max_restarts: "),
    ({"cpu_affinity": {"raas": ["one"]}}, r"recipe\.cpu_affinity\.raas: "),
    ({"cpu_affinity": {"gpu": [0]}}, r"recipe\.cpu_affinity\.gpu: unknown key"),
    ({"env": {"trainer": {"X": [1, 2]}}}, r"recipe\.env\.trainer: got"),
    ({"port": "eighty"}, r"recipe\.port: "),
    ({"stop": {"target_accuracy": 1.5}}, r"recipe\.stop\.target_accuracy: "),
    ({"stop": {"max_wall_s": "10 minutes"}}, r"recipe\.stop\.max_wall_s: "),
    ({"balance": {"every": -1}}, r"recipe\.balance\.every: "),
    ({"raas": "vllm"}, r"recipe\.raas: must be a list"),
    ({"dataflow": ["x"]}, r"recipe\.dataflow: must be a mapping"),
])
def test_bad_values_and_nested_keys_are_named(tmp_path, changes, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(child(tmp_path, **changes))


def test_optional_keys_are_accepted(tmp_path):
    recipe = load_recipe(child(tmp_path, supervise=False, port=8500, pythonpath=["."],
                               balance={"every": 0},
                               stop={"max_wall_s": 600, "target_accuracy": 0.9}))
    assert recipe["supervise"] is False and recipe["stop"]["max_wall_s"] == 600
    assert recipe["stop"]["target_accuracy"] == 0.9 and recipe["port"] == 8500


def test_the_schema_fills_in_nothing():
    """The launcher reads the mapping as written: validation adds no defaults."""
    recipe = yaml.safe_load(TOY.read_text())
    before = yaml.safe_dump(recipe)
    validate_recipe(recipe)
    assert yaml.safe_dump(recipe) == before


def test_missing_sections_are_named():
    recipe = yaml.safe_load(TOY.read_text())
    del recipe["trainers"]
    with pytest.raises(SchemaError, match=r"recipe\.trainers: missing"):
        validate_recipe(recipe)


def test_stop_versions_may_be_derived_from_max_steps(tmp_path):
    recipe = yaml.safe_load(TOY.read_text())
    del recipe["stop"]["versions"]  # the trainer's max_steps (150) says it
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert "versions" not in load_recipe(path)["stop"]  # as written; the launcher derives it
    # stated and contradicting the trainer: `astralight run --check` says so (run_stop decides)
    from astralight.launch.check import check_recipe

    recipe["stop"]["versions"] = 20
    path.write_text(yaml.safe_dump(recipe))
    assert load_recipe(path)["stop"]["versions"] == 20
    with pytest.raises(RecipeError, match=r"recipe\.stop\.versions \(20\) and "
                                          r"recipe\.trainers\[0\]\.trainer\.max_steps"):
        check_recipe(path, components=False)


def test_defaults_agree_with_the_code_that_applies_them():
    from astralight.launch.stop import STOP_DEFAULTS
    from astralight.launch.supervise import SUPERVISE_DEFAULTS

    assert AUTOSCALE_DEFAULTS == {f.name: f.default for f in dataclasses.fields(AutoscaleSection)}
    supervise = {f.name: f.default for f in dataclasses.fields(SuperviseSection)}
    assert supervise == {"enabled": True, **SUPERVISE_DEFAULTS}
    assert {f.name for f in dataclasses.fields(StopSection)} == set(STOP_DEFAULTS)


def test_the_schema_declares_every_key_the_launcher_reads():
    """Every ``recipe["KEY"]`` / ``recipe.get("KEY")`` of the launcher's modules is a field."""
    sources = sorted((ROOT / "astralight" / "launch").glob("*.py"))
    read = set()
    for source in sources:
        read |= set(re.findall(r'recipe(?:\.get\(|\[)"(\w+)"', source.read_text()))
    assert read >= {"dataflow", "raas", "trainers", "stop", "prepare", "autoscale"}
    assert read <= {f.name for f in dataclasses.fields(Recipe)}, read - {
        f.name for f in dataclasses.fields(Recipe)}
