"""Helpers for the integration tests that fit the policy under FSDP2 (``ModelParallelStrategy``
/ ``FSDP2Strategy``) on CPU: :func:`_identity`, the ``collate_fn`` that hands already collated
batches through a ``DataLoader``, and :func:`_full_state`, the policy's full (gathered) state dict.
Their fixtures (``batches``, ``clean_dist``) are in ``tests/integration/conftest.py``.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

import torch

from astralight.policy import M2POPolicy


def _identity(x):
    return x


def _full_state(policy: M2POPolicy) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if policy._sharded:
        state = get_model_state_dict(policy.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
    else:
        state = policy.model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}
