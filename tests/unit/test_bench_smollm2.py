"""The pure parts of tests/benchmarks/bench_smollm2.py: its two run arms' recipes. Its runs need
the real model and the whole system, and are run by hand."""

from __future__ import annotations

from astralight.launch.recipe_schema import validate_recipe
from tests.benchmarks import bench_smollm2 as bench


def test_the_lora_arm_is_the_example_and_the_others_publish_adapters_or_train_full_weights():
    base = bench.example_recipe(bench.EXAMPLE)
    arms = {arm: bench.arm_recipe(base, arm, 3) for arm in bench.RUN_ARMS}
    for recipe in arms.values():
        validate_recipe(recipe)
        assert recipe["stop"]["versions"] == 3 == recipe["trainers"][0]["trainer"]["max_steps"]
    lora, adapter, full = arms["lora"], arms["adapter"], arms["full"]
    assert lora["trainers"][0]["model"] == base["trainers"][0]["model"]
    assert lora["trainers"][0]["model"]["init_args"]["lora"]["publish"] == "merged"
    assert not lora["raas"][0]["engines"]["policy"].get("enable_lora")
    assert adapter["trainers"][0]["model"]["init_args"]["lora"]["publish"] == "adapter"
    assert adapter["raas"][0]["engines"]["policy"]["enable_lora"] is True
    assert adapter["raas"][0]["engines"]["policy"]["max_lora_rank"] == 16
    assert full["trainers"][0]["model"]["init_args"]["lora"] is None
    assert not full["raas"][0]["engines"]["policy"].get("enable_lora")
    # the base is untouched
    assert base["trainers"][0]["model"]["init_args"]["lora"]["publish"] == "merged"
