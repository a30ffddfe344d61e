"""``astralight run --export-configs``: one file per component, none overwritten by another."""

from __future__ import annotations

from pathlib import Path

import yaml

from astralight.launch import export_configs, export_file_stems

ROOT = Path(__file__).resolve().parents[2]


def test_each_component_of_a_kind_gets_its_own_file_when_there_are_several():
    assert export_file_stems(["dataflow", "raas-0", "trainer-policy"]) == {
        "dataflow": "dataflow", "raas-0": "raas", "trainer-policy": "trainer"}
    assert export_file_stems(["dataflow", "raas-0", "raas-1", "trainer-solver",
                              "trainer-verifier"]) == {
        "dataflow": "dataflow", "raas-0": "raas-0", "raas-1": "raas-1",
        "trainer-solver": "trainer-solver", "trainer-verifier": "trainer-verifier"}


def test_the_multi_agent_recipe_exports_both_trainers(tmp_path):
    """The verifier's config used to overwrite the solver's (both were trainer.yaml)."""
    written = export_configs(ROOT / "examples" / "multi_agent" / "recipe.yaml", tmp_path)
    names = sorted(p.name for p in written)
    assert len(names) == len(set(names))
    trainers = [p for p in written if p.name.startswith("trainer")]
    assert len(trainers) == 2 and {p.name for p in trainers} == {
        "trainer-solver.yaml", "trainer-verifier.yaml"}
    model_ids = {yaml.safe_load(p.read_text())["model"]["init_args"]["model_id"] for p in trainers}
    assert model_ids == {"solver", "verifier"}
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # nothing else, nothing twice
