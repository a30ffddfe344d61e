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
    best = BestEvalCheckpoint(str(tmp_path / "ckpt"), every_n_steps=1, wait_final_eval_s=0)
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
    with pytest.raises(ValueError, match="wait_final_eval_s: seconds, must be >= 0"):
        BestEvalCheckpoint(str(tmp_path), wait_final_eval_s=-1)
    best = BestEvalCheckpoint(str(tmp_path / "ckpt"))
    best.client = FakeMonitorClient({})
    with pytest.raises(ValueError, match="needs a WeightPublisher"):
        fit(tiny_model_dir, FakeDataflowClient(tiny_model_dir), [best], max_steps=1)


def test_the_last_version_is_saved_asked_for_and_kept_when_best(tiny_model_dir, tmp_path):
    """A fit whose last version is not a multiple of eval.every (max_steps 5, evals every 2): its
    checkpoint is saved too, its evaluation requested at the end of fit and waited for; in a run
    the last version is often the best."""
    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, worker="thread")
    publisher.client = fake
    evals = {2: {"complete": True, "avg_at_k": 0.5}, 4: {"complete": True, "avg_at_k": 0.3}}
    asked = []

    def run_eval(evals, version):  # the service evaluates the requested version
        asked.append(version)
        evals[version] = {"complete": True, "avg_at_k": 0.9}

    best = BestEvalCheckpoint(str(tmp_path / "ckpt"), every_n_steps=1, wait_final_eval_s=30)
    best.client = FakeMonitorClient({}, evals=evals, on_request_eval=run_eval, eval_every=2)
    fit(tiny_model_dir, fake, [publisher, best], max_steps=5)
    assert asked == [5]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["best.ckpt", "best.json"]
    assert json.loads((tmp_path / "ckpt" / "best.json").read_text()) == {
        "version": 5, "avg_at_k": 0.9}
    ckpt = torch.load(tmp_path / "ckpt" / "best.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 5


def test_a_version_the_publisher_skipped_is_not_waited_for(tiny_model_dir, tmp_path):
    """A publisher that falls behind publishes only its newest snapshot: a version it skipped is
    never evaluated, so its checkpoint is deleted once a later version was scheduled."""
    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, worker="thread")
    publisher.client = fake
    evals = {4: {"complete": True, "avg_at_k": 0.25}}  # v2 was never published
    best = BestEvalCheckpoint(str(tmp_path / "ckpt"), every_n_steps=1, wait_final_eval_s=30)
    best.client = FakeMonitorClient({}, evals=evals, eval_every=2)
    fit(tiny_model_dir, fake, [publisher, best], max_steps=4)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["best.ckpt", "best.json"]
    assert json.loads((tmp_path / "ckpt" / "best.json").read_text()) == {
        "version": 4, "avg_at_k": 0.25}
