"""The pure parts of tests/benchmarks/bench_smollm2.py: its two run arms' recipes. Its runs need
the real model and the whole system, and are run by hand."""

from __future__ import annotations

from astralight.launch.recipe_schema import validate_recipe
from tests.benchmarks import bench_smollm2 as bench


def test_the_lora_arm_is_the_example_and_the_full_arm_trains_and_serves_full_weights():
    base = bench.example_recipe(bench.EXAMPLE)
    lora, full = bench.arm_recipe(base, "lora", 3), bench.arm_recipe(base, "full", 3)
    for recipe in (lora, full):
        validate_recipe(recipe)
        assert recipe["stop"]["versions"] == 3 == recipe["trainers"][0]["trainer"]["max_steps"]
    assert lora["trainers"][0]["model"]["init_args"]["lora"]["publish"] == "adapter"
    assert lora["raas"][0]["engines"]["policy"]["enable_lora"] is True
    assert full["trainers"][0]["model"]["init_args"]["lora"] is None
    assert "enable_lora" not in full["raas"][0]["engines"]["policy"]
    assert base["trainers"][0]["model"]["init_args"]["lora"] is not None  # the base is untouched
