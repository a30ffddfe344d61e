"""Successive small weight states for the RaaS weight-sync tests (:func:`states`).

The fakes of the dataflow the RaaS tests talk to (:class:`~tests.fakes.FakeStore`,
:class:`~tests.fakes.FakeDataflow`, :class:`~tests.fakes.BatchingDataflow`) are in
:mod:`tests.fakes`, with the contract they keep.
"""

from __future__ import annotations

import torch


def states(n, seed=0):
    """n successive small states, each changing a few elements (like RL steps)."""
    g = torch.Generator().manual_seed(seed)
    state = {"a.weight": torch.randn(8, 16, generator=g), "b.bias": torch.randn(16, generator=g)}
    out = []
    for _ in range(n):
        state = {k: v.clone() for k, v in state.items()}
        state["a.weight"][0, :3] += 0.5
        out.append(state)
    return out
