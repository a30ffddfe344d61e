"""The pure parts of tests/benchmarks/bench_vs_trl.py: its recipes (per task and config), its
figures per sample and per second, its arguments. The bench's runs need the whole system and
TRL, and are run by hand."""

from __future__ import annotations

import json

import pytest
import yaml

from astralight.launch.recipe import load_recipe
from astralight.launch.recipe_schema import validate_recipe
from tests.benchmarks import bench_vs_trl as bench


def test_the_bench_recipe_is_the_toy_with_the_task_swapped_in_and_loads(tmp_path):
    toy_lr = yaml.safe_load(bench.TOY_RECIPE.read_text())["trainers"][0]["model"]["init_args"]["lr"]
    assert toy_lr != 1e-3  # so that the override below shows
    recipe = bench.astra_recipe(600, 8765, ["trainers.0.model.init_args.lr=1e-3",
                                             "dataflow.group_size=16"])
    validate_recipe(recipe)
    toy = yaml.safe_load(bench.TOY_RECIPE.read_text())
    assert recipe["raas"] == toy["raas"] and recipe["cpu_affinity"] == toy["cpu_affinity"]
    assert recipe["dataflow"]["source"]["class_path"] == "astralight.tasks.facts.FactSource"
    assert recipe["dataflow"]["eval"]["source"] is None  # the bench evaluates afterwards
    assert recipe["prepare"]["function"] == "astralight.tasks.facts.build_facts_policy"
    assert recipe["stop"]["max_wall_s"] == 600 and recipe["port"] == 8765
    assert recipe["trainers"][0]["model"]["init_args"]["lr"] == 1e-3
    assert recipe["dataflow"]["group_size"] == 16
    assert toy["trainers"][0]["model"]["init_args"]["lr"] == toy_lr  # the toy's file untouched
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    loaded = load_recipe(path)
    assert loaded["stop"]["max_wall_s"] == 600


def test_the_parity_config_is_trls_grpo_set_by_recipe_keys_alone(tmp_path):
    keys = bench.config_keys("parity", "structured", 3e-4)
    recipe = bench.astra_recipe(200, 8765, keys, task="structured", seed=2)
    validate_recipe(recipe)
    model = recipe["trainers"][0]["model"]["init_args"]
    assert recipe["dataflow"]["max_staleness"] == 0 and recipe["dataflow"]["group_size"] == 8
    assert recipe["trainers"][0]["data"]["init_args"]["batch_size"] == bench.TRL_BATCH
    assert model["minibatches"] == 1 and model["batch_passes"] == 1
    assert model["loss"] == "ppo_clip" and model["lr"] == 3e-4 and model["grad_clip"] == 1.0
    assert model["kl_coef"] == 0.0  # TRL's beta 0, whatever the toy's default penalty
    engine = recipe["raas"][0]["engines"]["policy"]
    assert engine["dtype"] == "float32"
    publisher = recipe["trainers"][0]["trainer"]["callbacks"][0]
    assert publisher["class_path"].endswith("WeightPublisher")
    assert publisher["init_args"]["precision"] == "fp32"
    assert recipe["raas"][0]["workflow"]["init_args"]["sampling"]["max_tokens"] == 4
    # the task and the seed reach every component
    assert recipe["dataflow"]["source"]["class_path"] == "astralight.tasks.cipher.CipherSource"
    assert recipe["prepare"]["function"] == "astralight.tasks.cipher.build_cipher_policy"
    assert recipe["seed"] == 2 and recipe["trainers"][0]["seed_everything"] == 2
    assert recipe["raas"][0]["seed"] == 2
    assert bench.config_keys("defaults", "facts", 3e-4) == []
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    load_recipe(path)  # the publisher's precision is a key the schema knows


def test_the_smollm2_task_is_the_example_recipe_set_to_trls_grpo(tmp_path):
    """``--task smollm2`` runs examples/smollm2_math/recipe.yaml as it ships (its model, task,
    LoRA shape and temperature), in-run evals off, with the parity keys at its batch of 32."""
    shipped = yaml.safe_load((bench.ROOT / bench.TASKS["smollm2"]["recipe"]).read_text())
    keys = bench.config_keys("parity", "smollm2", 5e-4)
    assert "trainers.0.data.init_args.batch_size=32" in keys and "dataflow.group_size=8" in keys
    recipe = bench.astra_recipe(600, 8765, keys, task="smollm2", seed=1)
    validate_recipe(recipe)
    assert recipe["prepare"] == shipped["prepare"]
    assert recipe["dataflow"]["source"] == shipped["dataflow"]["source"]
    assert recipe["dataflow"]["eval"]["source"] is None
    model = recipe["trainers"][0]["model"]["init_args"]
    assert model["lora"] == shipped["trainers"][0]["model"]["init_args"]["lora"]
    assert model["temperature"] == bench.TASKS["smollm2"]["temperature"] == 0.7
    assert model["loss"] == "ppo_clip" and model["lr"] == 5e-4
    assert recipe["dataflow"]["max_staleness"] == 0 and recipe["stop"]["max_wall_s"] == 600
    sampling = recipe["raas"][0]["workflow"]["init_args"]["sampling"]
    assert sampling == {"temperature": 0.7, "max_tokens": 48}
    lora = bench.TASKS["smollm2"]["lora"]  # TRL's adapter shape is the recipe's
    assert (lora["r"], lora["alpha"], lora["target_modules"]) == (
        model["lora"]["r"], model["lora"]["alpha"], model["lora"]["target_modules"])
    assert bench.TASKS["smollm2"]["table"].items() <= shipped["dataflow"]["source"][
        "init_args"].items()


def test_trls_lora_snapshot_is_the_merged_weights_under_the_base_names():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, tie_word_embeddings=True))
    names = set(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            lora_dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)  # B starts at 0: give the adapters an effect
    ids = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    state = bench.merged_state(model)
    assert set(state) == names
    plain = LlamaForCausalLM(base.config)
    plain.load_state_dict(state)
    with torch.no_grad():
        got = plain(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    with torch.no_grad():  # the adapters were not merged into the model itself
        assert torch.equal(model(input_ids=ids).logits, want)


def _run(accs, budget=600, per_point=100, milestones=()):
    n = len(accs) - 1
    run = {"curve": [{"t": budget * i / n, "acc": a, "samples": per_point * i, "steps": i}
                     for i, a in enumerate(accs)]}
    if milestones:
        run["sample_curve"] = [{"t": None, "acc": a, "samples": s, "steps": 0}
                               for s, a in milestones]
    return run


def test_figures_time_astralight_to_trls_best_and_final():
    out = bench.figures([_run([0.1, 0.5, 0.7, 0.7])], [_run([0.1, 0.3, 0.6, 0.65])], [1.0])
    assert out["trl_best"] == 0.65 and out["trl_wall_to_trl_best"] == 600
    assert out["astra_wall_to_trl_best"] == 400 and out["ratio_wall_to_trl_best"] == 0.667
    assert out["trl_wall_s"] == 600 and out["astra_wall_to_trl_final"] == 400
    assert out["astra_acc_at_budget"] == 0.7 and out["trl_acc_at_budget"] == 0.65
    assert out["astra_steps"] == 3 and out["trl_samples"] == 300
    never = bench.figures([_run([0.1, 0.1, 0.2, 0.3])], [_run([0.1, 0.3, 0.6, 0.65])], [1.0])
    assert never["astra_wall_to_trl_best"] is None and never["ratio_wall_to_trl_best"] is None
    assert never["astra_wall_to_trl_final"] is None
    json.dumps(out)
    assert bench.points(600, 3) == [0, 200, 400, 600]


def test_accuracy_per_sample_is_interpolated_at_shared_points_for_every_seed():
    run = _run([0.0, 0.4, 0.8], per_point=100)["curve"]
    assert bench.acc_at_samples(run, 0) == 0.0
    assert bench.acc_at_samples(run, 50) == pytest.approx(0.2)
    assert bench.acc_at_samples(run, 150) == pytest.approx(0.6)
    assert bench.acc_at_samples(run, 999) == 0.8  # past the end: the last accuracy
    # astralight reached 200 samples, TRL 1,000: points run to the fewest (200); TRL's
    # milestone snapshots at astralight's counts sit between its wall-time points
    astra = [_run([0.1, 0.3, 0.5], per_point=100), _run([0.1, 0.2, 0.4], per_point=100)]
    trl = [_run([0.1, 0.9], per_point=1000, milestones=[(100, 0.2), (200, 0.3)])]
    out = bench.figures(astra, trl, [1.0], n_samples_points=2)
    assert out["samples_points"] == [0, 100, 200]
    assert out["astra_acc"] == [[0.1, 0.3, 0.5], [0.1, 0.2, 0.4]]
    assert out["trl_acc"] == [[0.1, 0.2, 0.3]]
    assert out["parity_met"] is True  # astralight's mean >= the lowest TRL seed everywhere
    assert out["astra_acc_at_budget_seeds"] == [0.5, 0.4]
    assert out["astra_acc_at_budget"] == pytest.approx(0.45)
    behind = bench.figures(astra, [_run([0.1, 0.9], per_point=1000,
                                        milestones=[(100, 0.5), (200, 0.6)])], [1.0],
                           n_samples_points=2)
    assert behind["parity_met"] is False
    # the per-seed curves name every evaluated row in order of samples (milestones included)
    assert [row[1] for row in out["trl_runs"][0]["curve"]] == [0, 100, 200, 1000]
    json.dumps(out)


def test_an_arm_not_run_has_null_figures_not_the_warm_starts():
    alone = bench.figures([_run([0.1, 0.5, 0.7, 0.7])], None, [1.0])
    assert alone["astra_acc_at_budget"] == 0.7 and alone["astra_samples"] == 300
    assert alone["warm_start_acc"] == 0.1 and alone["parity_met"] is None
    for key in ("trl_acc_at_budget", "trl_best", "trl_wall_to_trl_best", "astra_wall_to_trl_best",
                "ratio_wall_to_trl_best", "trl_samples", "trl_steps", "trl_curve", "trl_acc",
                "trl_runs", "astra_wall_to_trl_final"):
        assert alone[key] is None, key
    trl_only = bench.figures(None, [_run([0.1, 0.3, 0.6, 0.65])], [1.0])
    assert trl_only["trl_best"] == 0.65 and trl_only["trl_wall_to_trl_best"] == 600
    assert trl_only["astra_acc_at_budget"] is None and trl_only["astra_curve"] is None
    json.dumps(alone)


def test_the_plot_draws_both_axes_for_every_seed(tmp_path):
    out = bench.figures([_run([0.1, 0.5, 0.7])] * 2,
                        [_run([0.1, 0.3, 0.6], milestones=[(50, 0.2)])] * 3, [1.0])
    bench.plot(out, tmp_path / "acc.png", "structured")
    assert (tmp_path / "acc.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, flag", [(["--arms", "astra,trll"], "--arms"),
                                        (["--seeds", "0"], "--seeds"),
                                        (["--task", "sums"], "--task"),
                                        (["--config", "fast"], "--config"),
                                        (["--budget-s", "0"], "--budget-s")])
def test_bad_arguments_name_the_flag_before_anything_runs(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        bench.main([*argv, "--out-dir", str(tmp_path / "out")])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_evaluation_writes_each_accuracy_as_it_goes_and_resumes_where_it_stopped(
        tmp_path, monkeypatch):
    snaps = [tmp_path / f"{i}.safetensors" for i in range(3)]
    for path in snaps:
        path.write_bytes(b"")
    runs = [[{"curve": [{"snapshot": None}, {"snapshot": str(snaps[0])}],
              "sample_curve": [{"snapshot": str(snaps[1])}]}],
            [{"curve": [{"snapshot": None}, {"snapshot": str(snaps[2])}]}]]
    calls = []

    def stopped_after_two(init, snapshot, task):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the evaluation is stopped part-way
        calls.append(snapshot)
        return 0.25 * len(calls)

    monkeypatch.setattr(bench, "evaluate", stopped_after_two)
    with pytest.raises(KeyboardInterrupt):
        bench.evaluate_all(tmp_path, tmp_path, "smollm2", runs, log=lambda *a: None)
    kept = json.loads((tmp_path / "eval_cache.json").read_text())
    assert len(kept) == 2  # both accuracies known before the stop were written

    calls.clear()
    monkeypatch.setattr(bench, "evaluate", lambda init, snapshot, task: calls.append(snapshot) or 0.9)
    bench.evaluate_all(tmp_path, tmp_path, "smollm2", runs, log=lambda *a: None)
    assert len(calls) == 2  # only the two left: nothing evaluated twice
    accs = {row["snapshot"]: row["acc"] for arm in runs for run in arm
            for row in run["curve"] + run.get("sample_curve", [])}
    assert sorted(accs.values()) == sorted([*kept.values(), 0.9, 0.9])
    assert len(json.loads((tmp_path / "eval_cache.json").read_text())) == 4


def test_evaluate_only_names_the_missing_run_and_how_to_train_it(tmp_path):
    with pytest.raises(SystemExit, match=r"seed0/astra_curve.json is missing: train seed 0's "
                                         r"astra arm first"):
        bench.saved_run(tmp_path, "astra", 0)
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "trl_curve.json").write_text(json.dumps({"curve": [{"t": 0}]}))
    assert bench.saved_run(tmp_path, "trl", 0) == {"curve": [{"t": 0}], "seed": 0}
