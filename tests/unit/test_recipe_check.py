"""``astralight run --check`` (astralight.launch.check): every component config is parsed by its own
parser, every local path is checked, and every problem names the recipe key; nothing starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from astralight.launch.check import check_recipe, explain, trainer_arguments
from astralight.launch.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "toy" / "recipe.yaml"
MULTI = ROOT / "examples" / "multi_agent" / "recipe.yaml"


def child(tmp_path: Path, base: Path = TOY, **changes) -> Path:
    path = tmp_path / "child.yaml"
    path.write_text(yaml.safe_dump({"extends": str(base), **changes}))
    return path


def with_source(tmp_path: Path, source: dict, **changes) -> Path:
    """The toy recipe with its train source replaced (not merged: a new class takes other
    arguments), as a recipe of its own."""
    recipe = yaml.safe_load(TOY.read_text())
    recipe["dataflow"]["source"] = source
    recipe.update(changes)
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_the_toy_recipe_passes_with_its_init_model_not_built_yet():
    result = check_recipe(TOY)
    assert result.components == ["dataflow", "raas-0", "trainer-policy"]
    assert any("{init_model}: built by recipe.prepare.function" in n for n in result.notes)
    assert result.line().startswith(f"OK: {TOY}: 3 component configs")


def test_the_multi_agent_recipes_two_init_models_are_stand_ins_too():
    result = check_recipe(MULTI)
    assert result.components == ["dataflow", "raas-0", "trainer-solver", "trainer-verifier"]


def test_a_trainer_key_typo_names_the_key_and_the_closest_one(tmp_path):
    path = child(tmp_path, trainers={"policy": {"trainer": {"max_step": 3}}})
    with pytest.raises(RecipeError, match=r"recipe\.trainers\[0\]\.trainer\.max_step: unknown key"
                                          r".*did you mean 'max_steps'\?"):
        check_recipe(path)


def test_the_trainer_precheck_knows_lightnings_arguments():
    names = trainer_arguments()
    assert names is not None and {"max_steps", "callbacks", "logger"} <= set(names)


@pytest.mark.parametrize("changes, message", [
    ({"trainers": {"policy": {"model": {"init_args": {"lrr": 1.0}}}}},
     r"recipe\.trainers\[0\]\.model\.init_args\.lrr: unknown key \(astralight\.policy\.M2POPolicy "
     r"has no argument 'lrr'\); did you mean 'lr'\?"),
    ({"trainers": {"policy": {"trainer": {"callbacks": {0: {"init_args": {"every_n_step": 1}}}}}}},
     r"recipe\.trainers\[0\]\.trainer\.callbacks\[0\]\.init_args\.every_n_step: .*"
     r"did you mean 'every_n_steps'"),
    ({"dataflow": {"group_sise": 4}}, r"recipe\.dataflow\.group_sise: unknown key; did you mean "
                                      r"'group_size'"),
    ({"dataflow": {"eval": {"evry": 5}}}, r"recipe\.dataflow\.eval\.evry: .*did you mean 'every'"),
    ({"dataflow": {"source": {"init_args": {"max_operandd": 3}}}},
     r"recipe\.dataflow\.source\.init_args\.max_operandd: .*did you mean 'max_operand'"),
    ({"raas": {0: {"engines": {"policy": {"max_model_length": 64}}}}},
     r"recipe\.raas\[0\]\.engines\.policy\.max_model_length: .*did you mean 'max_model_len'"),
    ({"raas": {0: {"max_concurency": 8}}}, r"recipe\.raas\[0\]\.max_concurency: unknown key; did "
                                           r"you mean 'max_concurrency'"),
    ({"raas": {0: {"workflow": {"class_path": "astralight.workflows.single_turn.Nope"}}}},
     r"recipe\.raas\[0\]\.workflow\.class_path: cannot import"),
    ({"prepare": {"kwargs": {"sft_step": 10}}},
     r"recipe\.prepare\.kwargs\.sft_step: .*did you mean 'sft_steps'"),
    ({"prepare": {"function": "astralight.tasks.warmstart.nope"}},
     r"recipe\.prepare\.function: cannot import"),
    ({"pythonpath": ["no_such_folder"]}, r"recipe\.pythonpath\[0\]: .* is not a folder"),
    ({"dataflow": {"source": {"class_path": "astralight.tasks.qa.QASource",
                              "init_args": {"path": "no/such/train.jsonl"}}}},
     r"recipe\.dataflow\.source\.init_args\.path: 'no/such/train\.jsonl' does not exist"),
    ({"prepare": None, "trainers": {"policy": {"model": {"init_args": {
        "model_path": "/no/such/model"}}}}},
     r"recipe\.trainers\[0\]\.model\.init_args\.model_path: '/no/such/model' does not exist"),
])
def test_each_component_problem_names_the_recipe_key(tmp_path, changes, message):
    with pytest.raises(RecipeError, match=message):
        check_recipe(child(tmp_path, **changes))


@pytest.mark.parametrize("changes, message", [
    ({"trainers": {"policy": {"data": {"init_args": {"model_id": "solver"}}}}},
     r"recipe\.trainers\[0\]\.data\.init_args\.model_id: 'solver', but the trainer's policy is "
     r"'policy'"),
    ({"dataflow": {"workflow": "tool_agent"}},
     r"recipe\.raas\[0\]\.workflow: astralight\.workflows\.single_turn\.SingleTurnWorkflow runs "
     r"'single_turn' tasks, but recipe\.dataflow\.workflow is 'tool_agent'"),
    ({"trainers": {"policy": {"model": {"init_args": {"lora": {"r": 8}}}}}},
     r"recipe\.raas\[0\]\.engines\.policy\.enable_lora: the trainer publishes LoRA adapters"),
])
def test_mistakes_between_components_are_named_before_anything_starts(tmp_path, changes, message):
    """What no one component's parser sees (issue 42): components=False, so these are found
    without importing any component parser."""
    with pytest.raises(RecipeError, match=message):
        check_recipe(child(tmp_path, **changes), components=False)


def test_an_adapter_rank_above_the_engines_max_lora_rank_is_named(tmp_path):
    lora = {"trainers": {"policy": {"model": {"init_args": {"lora": {"r": 32}}}}}}
    with pytest.raises(RecipeError, match=r"recipe\.raas\[0\]\.engines\.policy\.max_lora_rank: "
                                          r"16, below the trainer's adapter rank .*lora\.r: 32\)"):
        check_recipe(child(tmp_path, **lora, raas={0: {"engines": {"policy": {
            "enable_lora": True}}}}), components=False)
    check_recipe(child(tmp_path, **lora, raas={0: {"engines": {"policy": {
        "enable_lora": True, "max_lora_rank": 32}}}}), components=False)


def test_the_checks_defaults_are_the_engines_and_the_lora_specs():
    import inspect

    from astralight.launch.check import LORA_DEFAULT_R, VLLM_ENGINE_MAX_LORA_RANK
    from astralight.trainer.lora import LoraSpec
    from astralight.raas.vllm_engine import VLLMEngine

    assert LoraSpec().r == LORA_DEFAULT_R
    default = inspect.signature(VLLMEngine.__init__).parameters["max_lora_rank"].default
    assert default == VLLM_ENGINE_MAX_LORA_RANK


def test_lora_adapters_pass_with_an_engine_that_loads_them_or_merged_publication(tmp_path):
    lora = {"trainers": {"policy": {"model": {"init_args": {"lora": {"r": 8}}}}}}
    check_recipe(child(tmp_path, **lora, raas={0: {"engines": {"policy": {
        "enable_lora": True}}}}), components=False)
    check_recipe(child(tmp_path, trainers={"policy": {"model": {"init_args": {"lora": {
        "r": 8, "publish": "merged"}}}}}), components=False)


def test_a_policy_the_dataflow_does_not_serve_is_named(tmp_path):
    recipe = yaml.safe_load(TOY.read_text())
    recipe["trainers"][0]["model"]["init_args"]["model_id"] = "polcy"
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match=r"recipe\.trainers\[0\]\.model\.init_args\.model_id: "
                                          r"'polcy' is not one of recipe\.dataflow\.model_ids"):
        check_recipe(path, components=False)


def test_a_fixed_port_in_use_is_named(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(RecipeError, match=rf"recipe\.port: {port} is in use on this machine"):
            check_recipe(child(tmp_path, port=port), components=False)


def test_paths_the_run_writes_and_hub_ids_are_not_errors(tmp_path):
    recipe = with_source(tmp_path, {"class_path": "astralight.tasks.qa.QASource",
                                    "init_args": {"path": "{run_dir}/data/train.jsonl",
                                                  "tokenizer_path": "Qwen/Qwen3-8B"}})
    result = check_recipe(recipe)
    assert any("recipe.dataflow.source.init_args.path" in n and "written by the run" in n
               for n in result.notes)
    assert any("'Qwen/Qwen3-8B' is no local folder" in n for n in result.notes)


def test_an_existing_data_file_is_counted(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "q", "answer": "a"}\n')
    result = check_recipe(with_source(tmp_path, {"class_path": "astralight.tasks.qa.QASource",
                                                 "init_args": {"path": str(data)}}))
    assert str(data) in result.paths


def test_a_plugin_on_the_recipes_pythonpath_is_found_by_the_components_parser(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "my_check_source.py").write_text(
        "from astralight.tasks.arithmetic import ArithmeticSource\n\n\n"
        "class MySource(ArithmeticSource):\n    pass\n")
    source = {"class_path": "my_check_source.MySource",
              "init_args": {"split": "train", "seed": 0, "max_operand": 49}}
    with pytest.raises(RecipeError, match=r"recipe\.dataflow\.source\.class_path: cannot import"):
        check_recipe(child(tmp_path, dataflow={"source": source}))
    path = child(tmp_path, dataflow={"source": source}, pythonpath=["plugins"])
    assert check_recipe(path).components[0] == "dataflow"
    sys.modules.pop("my_check_source", None)


def test_the_launcher_refuses_a_typo_before_anything_starts(tmp_path):
    from astralight.launch import run

    path = child(tmp_path, trainers={"policy": {"trainer": {"max_step": 3}}})
    with pytest.raises(RecipeError, match=r"trainer\.max_step"):
        run(path, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # no run folder, no prepare step, no process


def test_explain_turns_jsonargparse_messages_into_recipe_keys():
    message = ('Parser key "model": Does not validate against any of the Union subtypes '
               "Subtypes: [...] Errors: - Problem with given class_path 'astralight.policy."
               "M2POPolicy': Option 'lrr' is not accepted - Expected a <class 'NoneType'>")
    assert explain(message, "recipe.trainers[0]") == (
        "recipe.trainers[0].model.init_args.lrr: unknown key (astralight.policy.M2POPolicy has no "
        "argument 'lrr'); did you mean 'lr'?")
    assert explain('Parser key "group_size": Expected a <class \'int\'>. Got value: eight',
                   "recipe.dataflow") == "recipe.dataflow.group_size: expected int, got eight"
    assert explain("source.class_path: cannot import 'x.Y'", "recipe.dataflow") == (
        "recipe.dataflow.source.class_path: cannot import 'x.Y'")
    assert explain("something else", "recipe.raas[0]") == "recipe.raas[0]: something else"


def test_explain_names_the_value_a_choice_refused():
    """``loss: grpo`` used to end in a 300-character union dump cut before the value."""
    message = ('Parser key "model": Does not validate against any of the Union subtypes '
               "Subtypes: [...] Errors: - Problem with given class_path 'astralight.policy."
               "M2POPolicy': Parser key \"loss\": Expected a typing.Literal['m2po', "
               "'m2po_harmful', 'ppo_clip', 'tis_ppo'] - Expected a <class 'NoneType'>")
    config = {"model": {"class_path": "astralight.policy.M2POPolicy",
                        "init_args": {"loss": "grpo"}}}
    assert explain(message, "recipe.trainers[0]", config) == (
        "recipe.trainers[0].model.init_args.loss: got 'grpo'; expected one of 'm2po', "
        "'m2po_harmful', 'ppo_clip', 'tis_ppo'")
    config["model"]["init_args"]["loss"] = "ppo_clp"
    assert explain(message, "recipe.trainers[0]", config).endswith("did you mean 'ppo_clip'?")
