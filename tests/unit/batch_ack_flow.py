"""A real core :class:`Dataflow` on SQLite with groups of :data:`GROUP` and a batch-ack timeout
of :data:`TIMEOUT` seconds (:func:`make`), and the samples a RaaS pushes into it
(:func:`samples`); shared by the batch keep-alive and trainer-resumed unit tests.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

import numpy as np

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.protocol import Sample

GROUP = 2
TIMEOUT = 2.0


def samples(task, rewards=(0, 1)) -> list[Sample]:
    return [Sample(task_id=task.task_id, sample_index=i, model_id="policy",
                   token_ids=np.array([5, 6, 7], np.int32),
                   logprobs=np.array([0, -1, -1], np.float32),
                   loss_mask=np.array([0, 1, 1], np.uint8),
                   versions=np.array([-1, 0, 0], np.int32), reward=float(r))
            for i, r in enumerate(rewards)]


def make(tmp_path, **kw) -> Dataflow:
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=GROUP,
                                   batch_ack_timeout_s=TIMEOUT, **kw))
