"""Recipe checks of the launcher: bad recipes fail before anything starts, naming the key."""

from __future__ import annotations

import pytest
import yaml

from astralight.launch import _default_recipe
from astralight.launch.recipe import RecipeError, load_recipe, substitute
from astralight.launch.stop import resolve_versions


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


def test_versions_need_not_be_a_multiple_of_eval_every(tmp_path):
    # the stop sequence evaluates the last version whatever eval.every says (run_stop), so a
    # run may end between two scheduled evals; only a disagreement with max_steps is refused
    recipe = toy()
    recipe["stop"]["versions"] = recipe["dataflow"]["eval"]["every"] * 3 + 1
    del recipe["trainers"][0]["trainer"]["max_steps"]
    loaded = resolve_versions(load_recipe(write(tmp_path, recipe)))
    every = recipe["trainers"][0]["trainer"]["callbacks"][0]["init_args"]["every_n_steps"]
    assert loaded["trainers"][0]["trainer"]["max_steps"] == recipe["stop"]["versions"] * every


def test_versions_must_be_positive(tmp_path):
    recipe = toy()
    recipe["stop"]["versions"] = 0
    with pytest.raises(RecipeError, match="recipe.stop.versions"):
        load_recipe(write(tmp_path, recipe))


def test_placeholders_substituted_everywhere():
    out = substitute({"a": ["{run_dir}/x", {"b": "{init_model}"}], "n": 3},
                      {"run_dir": "/r", "init_model": "/m"})
    assert out == {"a": ["/r/x", {"b": "/m"}], "n": 3}


def test_committed_toy_component_configs_match_the_recipe(tmp_path):
    """configs/toy/ (docs/how-to/scale-out.md: each component on its own) is the recipe, exported."""
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


# ---------------------------------------------------------------------- recipe inheritance


def test_deep_merge_merges_mappings_and_replaces_everything_else():
    from astralight.launch.recipe import deep_merge

    parent = {"a": {"x": 1, "y": {"p": 1, "q": 2}}, "l": [1, 2, 3], "s": "old", "keep": True}
    child = {"a": {"y": {"q": 20, "r": 30}, "z": 3}, "l": [9], "s": {"now": "a mapping"}}
    assert deep_merge(parent, child) == {
        "a": {"x": 1, "y": {"p": 1, "q": 20, "r": 30}, "z": 3},
        "l": [9], "s": {"now": "a mapping"}, "keep": True}
    assert parent["a"]["y"] == {"p": 1, "q": 2}  # inputs untouched


def test_extends_chain_relative_to_each_file(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "mid").mkdir()
    recipe = toy()
    recipe["stop"]["versions"] = 20
    (tmp_path / "base" / "toy.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "mid" / "mid.yaml").write_text(yaml.safe_dump(
        {"extends": "../base/toy.yaml", "name": "mid", "dataflow": {"group_size": 4}}))
    (tmp_path / "leaf.yaml").write_text(yaml.safe_dump(
        {"extends": "mid/mid.yaml", "dataflow": {"sample_filters": ["zero_advantage"]},
         "stop": {"versions": 30}}))
    merged = load_recipe(tmp_path / "leaf.yaml")
    assert "extends" not in merged
    assert merged["name"] == "mid"
    assert merged["dataflow"]["group_size"] == 4
    assert merged["dataflow"]["sample_filters"] == ["zero_advantage"]
    assert merged["dataflow"]["source"] == recipe["dataflow"]["source"]  # inherited untouched
    assert merged["stop"]["versions"] == 30
    assert merged["stop"]["timeout_s"] == recipe["stop"]["timeout_s"]
    assert merged["trainers"] == recipe["trainers"]


def test_extends_checks_run_on_the_merged_recipe(tmp_path):
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(toy()))
    # the child alone lacks every section, merged it is complete: valid
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump({"extends": "toy.yaml"}))
    assert load_recipe(tmp_path / "ok.yaml")["stop"]["versions"] == toy()["stop"]["versions"]
    # a child that breaks a rule against its parent's values is caught
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(
        {"extends": "toy.yaml", "autoscale": {"min_instances": 2, "max_instances": 3,
                                              "initial": 5}}))
    with pytest.raises(RecipeError, match="recipe.autoscale.initial"):
        load_recipe(tmp_path / "bad.yaml")


def test_extends_missing_file_is_named(tmp_path):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"extends": "nowhere/base.yaml"}))
    with pytest.raises(RecipeError, match=r"recipe\.extends.*nowhere/base\.yaml"):
        load_recipe(tmp_path / "r.yaml")


def test_extends_cycle_is_named(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"extends": "b.yaml", "name": "a"}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"extends": "./a.yaml"}))
    with pytest.raises(RecipeError, match=r"recipe\.extends: cycle.*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_recipe(tmp_path / "a.yaml")
    (tmp_path / "self.yaml").write_text(yaml.safe_dump({"extends": "self.yaml"}))
    with pytest.raises(RecipeError, match=r"recipe\.extends: cycle"):
        load_recipe(tmp_path / "self.yaml")


def test_extends_must_be_a_path(tmp_path):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"extends": ["a.yaml"]}))
    with pytest.raises(RecipeError, match=r"recipe\.extends"):
        load_recipe(tmp_path / "r.yaml")


def test_export_configs_of_an_extending_recipe(tmp_path):
    """`astralight run --export-configs` writes the merged components' configs."""
    from astralight.launch import main

    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(toy()))
    (tmp_path / "child.yaml").write_text(yaml.safe_dump(
        {"extends": "toy.yaml", "dataflow": {"group_size": 4, "replay": {"ratio": 0.5}}}))
    assert main([str(tmp_path / "child.yaml"), "--export-configs", str(tmp_path / "out")]) == 0
    dataflow = yaml.safe_load((tmp_path / "out" / "dataflow.yaml").read_text())
    assert dataflow["group_size"] == 4 and dataflow["replay"] == {"ratio": 0.5}
    assert dataflow["source"] == toy()["dataflow"]["source"]
    assert "extends" not in dataflow
    assert (tmp_path / "out" / "trainer.yaml").exists() and (tmp_path / "out" / "raas.yaml").exists()


# ---------------------------------------------------------------------- run summary


def test_summary_reports_rollouts_trained_counters_plugins_and_per_version():
    from astralight.launch.summary import build_summary

    pol = {"current_version": 4, "samples_acked": 64, "samples_trained": 96,
           "rollouts_generated": 160, "groups_filtered": 3}
    stats = {"models": {"policy": pol, "other": {"rollouts_generated": 1}},
             "plugins": {"curators[0]": {"class": "GRESO", "metrics": {"p_easy": 0.5}}}}
    evals = {0: {"complete": True, "avg_at_k": 0.25, "pass_at_k": 0.5},
             2: {"complete": True, "avg_at_k": 0.5}, 4: {"complete": True, "avg_at_k": 0.75}}
    per_version = {"0": {"rollouts_generated": 64}, "1": {"rollouts_generated": 96}}
    out = build_summary(stats, evals, per_version, "policy", final_version=4)
    assert out["samples_trained"] == 96  # fresh + replayed, not samples_acked
    assert out["rollouts_generated"] == 160
    assert out["counters"] == pol
    assert out["plugins"] == stats["plugins"]
    assert out["per_version"] == per_version
    assert out["eval_accuracy_start"] == 0.25 and out["eval_accuracy_end"] == 0.75
    assert out["eval_versions"] == [0, 2, 4] and out["versions"] == 4


def test_summary_keeps_pass_at_k_and_benchmark_tables():
    """summary.json carries what a report without the dataflow DB needs for its eval tables."""
    from astralight.launch.summary import build_summary

    row = {"complete": True, "avg_at_k": 0.5, "pass_at_k": 0.75, "k": 4, "n": 8,
           "pass_at": {"1": 0.5, "4": 0.75}, "benchmark_average": 0.5,
           "benchmark_average_pass_at_k": 0.75, "benchmark_average_pass_at": {"1": 0.5},
           "benchmarks": {"aime24": {"avg_at_k": 0.5}}, "internal": 1}
    out = build_summary({"models": {}}, {4: row}, None, "policy", 4)
    assert out["eval"][4] == {k: v for k, v in row.items() if k not in ("complete", "internal")}


def test_summary_when_the_final_eval_or_counters_are_missing():
    from astralight.launch.summary import build_summary

    out = build_summary({"models": {}}, {0: {"complete": True, "avg_at_k": 0.25}}, None, "policy", 4)
    assert out["eval_accuracy_end"] is None and out["per_version"] is None
    assert out["plugins"] is None and out["rollouts_generated"] is None and out["counters"] == {}


def test_per_version_counters_route_failure_is_null(capsys):
    from astralight.launch import _free_port, _per_version_counters

    # nothing listens there: recorded as null, the run goes on
    assert _per_version_counters(f"http://127.0.0.1:{_free_port()}", "policy") is None
    assert "per-version counters not available" in capsys.readouterr().out


def test_per_version_counters_reads_the_route():
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from astralight.launch import _per_version_counters

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            body = json.dumps({"model_id": "policy",
                               "versions": {"0": {"rollouts_generated": 64}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert _per_version_counters(url, "policy") == {"0": {"rollouts_generated": 64}}
        assert seen == ["/v1/counters/policy"]
    finally:
        server.shutdown()
        server.server_close()


def test_summary_wait_fraction_and_wall_time_to_accuracy(tmp_path):
    import sqlite3

    from astralight.launch.summary import trainer_wait_fraction, wall_s_to_accuracy

    assert trainer_wait_fraction({"trainer_wait_ms": 30, "trainer_step_ms": 120}) == 0.25
    assert trainer_wait_fraction({}) is None
    con = sqlite3.connect(tmp_path / "dataflow.db")
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    con.execute("CREATE TABLE version_times (model_id TEXT, version INTEGER, published_at REAL)")
    con.execute("INSERT INTO meta VALUES ('started_at', '1000.0')")
    con.executemany("INSERT INTO version_times VALUES ('policy', ?, ?)",
                    [(10, 1030.0), (20, 1061.5), (30, 1090.0)])
    con.commit()
    con.close()
    evals = {0: {"complete": True, "avg_at_k": 0.2}, 10: {"complete": True, "avg_at_k": 0.6},
             20: {"complete": True, "avg_at_k": 0.86}, 30: {"complete": False, "avg_at_k": 0.9}}
    assert wall_s_to_accuracy(tmp_path, "policy", evals, 0.85) == 61.5  # v20, published at +61.5
    assert wall_s_to_accuracy(tmp_path, "policy", evals, 0.95) is None  # never reached
    assert wall_s_to_accuracy(tmp_path / "none", "policy", evals, 0.85) is None  # no state


def test_summary_has_the_tool_call_rate_of_a_tool_workflow_only():
    from astralight.launch.summary import build_summary, final_eval

    evals = {0: {"complete": True, "avg_at_k": 0.17, "tool_call_rate": 0.3},
             60: {"complete": True, "avg_at_k": 0.58, "tool_call_rate": 0.97}}
    out = build_summary({"models": {}}, evals, None, "policy", 60)
    assert (out["tool_call_rate_start"], out["tool_call_rate_end"]) == (0.3, 0.97)
    assert out["eval"][60]["tool_call_rate"] == 0.97
    assert final_eval(evals)["tool_call_rate_end"] == 0.97
    plain = build_summary({"models": {}}, {0: {"complete": True, "avg_at_k": 0.2}}, None, "policy", 0)
    assert "tool_call_rate_start" not in plain


def test_set_overrides_keys_by_dotted_path_and_names_the_bad_ones():
    from astralight.launch.recipe import apply_overrides

    recipe = {"stop": {"versions": 5}, "trainers": [{"model": {"init_args": {"lr": 1.0}}}]}
    apply_overrides(recipe, ["stop.versions=10", "trainers.0.model.init_args.lr=1e-4",
                             "dataflow.eval.source=null", "name=my run"])
    assert recipe["stop"]["versions"] == 10 and recipe["name"] == "my run"
    assert recipe["trainers"][0]["model"]["init_args"]["lr"] == 1e-4
    assert recipe["dataflow"] == {"eval": {"source": None}}
    for bad, why in (("trainers.1.x=1", "trainers is a list of 1 item"),
                     ("stop.versions.x=1", "stop.versions is int 10"),
                     ("stop..versions=1", "dotted path"), ("versions", "expected KEY=VALUE")):
        with pytest.raises(RecipeError, match=why):
            apply_overrides(recipe, [bad])


def test_run_set_and_print_recipe(capsys):
    """``astralight run --set ... --print-recipe`` prints the recipe as it would run; a key the
    schema does not know is named, against the recipe it came from, before anything starts."""
    from astralight.launch import main

    assert main(["--set", "stop.versions=7", "--set", "trainers.0.model.init_args.lr=2e-4",
                 "--print-recipe"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["stop"]["versions"] == 7
    assert printed["trainers"][0]["model"]["init_args"]["lr"] == 2e-4
    default = yaml.safe_load(_default_recipe().read_text())
    assert printed["raas"] == default["raas"]
    assert main(["--set", "stop.verions=3", "--print-recipe"]) == 2
    err = capsys.readouterr().err
    assert "recipe.stop.verions: unknown key; did you mean 'versions'" in err
    assert "with --set applied" in err and "/tmp/" not in err
