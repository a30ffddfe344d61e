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


def test_the_docs_page_is_generated_from_the_figures():
    rows = [{"arm": "engine", "dtype": "auto", "engine_start_s": 12.3, "requests": 64,
             "tokens_per_s": 151.2, "prompt_tokens_mean": 60.0, "completion_tokens_mean": 30.5,
             "truncated_share": 0.016},
            {"arm": "lora", "trainer_samples_per_s": 0.81, "eval_accuracy_start": 0.2,
             "eval_accuracy_end": 0.4, "trainer_tokens_per_s": 70.2,
             "trainer_step_s": 39.5, "full": {"n": 1, "bytes": 269 * 2**20, "latency_s": 3.0},
             "delta": {"n": 3, "bytes": 10 * 2**20, "full_bytes": 269 * 2**20,
                       "unchanged_bf16_share": 0.97, "latency_s": 1.25},
             "peak_rss_gib": {"dataflow": 0.2, "raas-0": 2.5, "trainer-policy": 3.1}},
            {"arm": "full", "trainer_samples_per_s": 0.5, "full": {}, "delta": {},
             "peak_rss_gib": {"raas-0": 2.6, "trainer-policy": 5.0}}]
    page = bench.markdown_page(rows, {"load_before": [1.0], "load_after": [2.0]},
                               "python tests/benchmarks/bench_smollm2.py --json", "abc1234",
                               "2-core AMD EPYC", "2026-12-07")
    assert "**Commit:** `abc1234`" in page and "2-core AMD EPYC" in page and "2026-12-07" in page
    assert "| vLLM (CPU) | auto | 12.3 s | 64 | **151.2** |" in page
    assert ("| lora | **0.81** | 70.2 | 39.5 s | 269.0 MiB | 10.0 MiB | 26.9x smaller | 0.97 | "
            "3.0 s / 1.25 s | 0.2 -> 0.4 |") in page
    assert "| full | **0.5** | - | - | - | - | - | - | - / - | - -> - |" in page
    assert "| arm | dataflow | raas-0 | trainer-policy |" in page
    assert "| full | - | 2.6 | 5.0 |" in page


def test_render_reads_an_earlier_outputs_rows_among_other_processes_lines(tmp_path):
    out = tmp_path / "bench.jsonl"
    out.write_text('(MainProcess pid=1) INFO vLLM says hello\n'
                   '{"arm": "engine", "tokens_per_s": 100.0, "requests": 8}\n'
                   '{"not": "a row"}\nnot json {\n'
                   '{"summary": {"load_before": [1.0], "load_after": [1.5]}}\n')
    rows, summary = bench.read_output(out)
    assert rows == [{"arm": "engine", "tokens_per_s": 100.0, "requests": 8}]
    assert summary == {"load_before": [1.0], "load_after": [1.5]}
    page = tmp_path / "page.md"
    assert bench.main(["--render", str(out), "--markdown", str(page), "--machine",
                       "2-core test box", "--arms", "engine"]) == 0
    text = page.read_text()
    assert "**100.0**" in text and "2-core test box" in text
    # the measuring command, quoted, without the rendering flag
    assert "bench_smollm2.py --markdown " in text and "--render" not in text
    assert "--machine '2-core test box'" in text
