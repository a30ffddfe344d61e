"""BestEvalCheckpoint (issue 37, item 3): the checkpoint of the best-evaluated version is kept as
``best.ckpt`` on a real ``Trainer.fit``, though each eval arrives after the weights moved on;
worse ones are deleted once their eval is complete, unevaluated ones wait."""

from __future__ import annotations

import json

import pytest
import torch

from astralight.callbacks import BestEvalCheckpoint, WeightPublisher
from tests.fakes import FakeDataflowClient, FakeMonitorClient
from tests.unit.publisher_fit import fit


def test_the_best_evaluated_version_is_kept_and_the_rest_settled(tiny_model_dir, tmp_path):
    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, worker="thread")
    publisher.client = fake
    # the dataflow evaluates every 2 versions; v6's evaluation has not finished
    evals = {2: {"complete": True, "avg_at_k": 0.5}, 4: {"complete": True, "avg_at_k": 0.8},
             6: {"complete": False, "avg_at_k": 0.1}}
    best = BestEvalCheckpoint(str(tmp_path / "ckpt"), every_n_steps=1)
    best.client = FakeMonitorClient({}, evals=evals, eval_every=2)
    _, trainer = fit(tiny_model_dir, fake, [publisher, best], max_steps=6)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["best.ckpt", "best.json", "version=6.ckpt"]
    assert json.loads((tmp_path / "ckpt" / "best.json").read_text()) == {
        "version": 4, "avg_at_k": 0.8}
    ckpt = torch.load(tmp_path / "ckpt" / "best.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4  # the weights of version 4, not of the step its eval came at
    # v6 is evaluated later (worse): settling deletes its checkpoint and keeps v4's
    evals[6] = {"complete": True, "avg_at_k": 0.3}
    best.settle(trainer)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["best.ckpt", "best.json"]


def test_it_needs_a_publisher_and_sane_settings(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="every_n_steps: must be >= 1"):
        BestEvalCheckpoint(str(tmp_path), every_n_steps=0)
    with pytest.raises(ValueError, match="eval_every: versions, must be >= 1"):
        BestEvalCheckpoint(str(tmp_path), eval_every=0)
    best = BestEvalCheckpoint(str(tmp_path / "ckpt"))
    best.client = FakeMonitorClient({})
    with pytest.raises(ValueError, match="needs a WeightPublisher"):
        fit(tiny_model_dir, FakeDataflowClient(tiny_model_dir), [best], max_steps=1)
