"""vocab_sizes: the dataflow refuses token ids a policy's embedding cannot look up (a broken or
hostile RaaS would otherwise crash the trainer); the launcher fills it from the models."""

import json

import pytest

from astralight.dataflow.config import DataflowConfig
from astralight.launch import component_configs


def test_vocab_sizes_are_checked_naming_the_field():
    DataflowConfig(model_ids=["policy"], vocab_sizes={"policy": 64})
    with pytest.raises(ValueError, match="vocab_sizes: 'other' is not one of model_ids"):
        DataflowConfig(model_ids=["policy"], vocab_sizes={"other": 64})
    with pytest.raises(ValueError, match="vocab_sizes.policy: must be a positive int"):
        DataflowConfig(model_ids=["policy"], vocab_sizes={"policy": 0})


def test_launcher_fills_vocab_sizes_from_each_trainers_model(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 77}))
    recipe = {"dataflow": {"model_ids": ["policy", "other"]}, "raas": [{}],
              "trainers": [{"model": {"init_args": {"model_id": "policy", "model_path": str(model)}}},
                           {"model": {"init_args": {"model_id": "other",
                                                    "model_path": str(tmp_path / "missing")}}}]}
    cfg = component_configs(recipe, tmp_path / "run", 8400)["dataflow"]
    assert cfg["vocab_sizes"] == {"policy": 77}  # a model not built yet is left unchecked
    recipe["dataflow"]["vocab_sizes"] = {"policy": 99}  # an explicit value wins
    assert component_configs(recipe, tmp_path / "run", 8400)["dataflow"]["vocab_sizes"] == {
        "policy": 99}


def test_launcher_fills_temperatures_from_each_trainers_policy(tmp_path):
    """A sample of another temperature is refused on ingest, not by the trainer mid-run."""
    recipe = {"dataflow": {"model_ids": ["policy", "other", "third"]}, "raas": [{}],
              "trainers": [{"model": {"init_args": {"model_id": "policy", "temperature": 0.7}}},
                           {"model": {"init_args": {"model_id": "other"}}},  # unset: not filled
                           {"model": {"init_args": {"model_id": "third", "temperature": 1}}},
                           {"model": {"init_args": {"model_id": "unserved", "temperature": 2.0}}}]}
    cfg = component_configs(recipe, tmp_path / "run", 8400)["dataflow"]
    assert cfg["temperatures"] == {"policy": 0.7, "third": 1.0}
    recipe["dataflow"]["temperatures"] = {"policy": 0.5}  # an explicit value wins
    assert component_configs(recipe, tmp_path / "run", 8400)["dataflow"]["temperatures"] == {
        "policy": 0.5, "third": 1.0}
