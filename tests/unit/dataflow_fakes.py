"""Shared helpers for tests of the dataflow core (import from here, never from another test
module): samples of a task as a RaaS would push them, and a published full version."""

from __future__ import annotations

import hashlib

import numpy as np

from astralight.dataflow.core import Dataflow
from astralight.protocol import Sample, WeightManifest
from tests.fakes import InProcessDataflow


def samples(task, rewards, version=0, model_id="policy", token_ids=(1, 2, 3)) -> list[Sample]:
    """One 3-token sample per reward (prompt token, two generated tokens of ``version``)."""
    return [Sample(task_id=task.task_id, sample_index=i, model_id=model_id,
                   token_ids=np.array(token_ids, np.int32),
                   logprobs=np.array([0, -1, -1], np.float32),
                   loss_mask=np.array([0, 1, 1], np.uint8),
                   versions=np.array([-1, version, version], np.int32), reward=float(r))
            for i, r in enumerate(rewards)]


def publish(flow: Dataflow, version: int, model_id: str = "policy") -> None:
    """Publish a one-file full version as a trainer does: upload (the route's steps), publish."""
    data = b"w%d" % version
    InProcessDataflow(flow).upload_weight_file(model_id, version, "model.safetensors", data)
    flow.publish(WeightManifest(model_id=model_id, version=version, kind="full",
                                files={"model.safetensors": {"sha256": hashlib.sha256(data)
                                                             .hexdigest()}}))
