"""Train/inference mismatch: the trainer's log-probs against the sampler's, on the same weights.

The rollout engine and the trainer compute the same policy differently: another precision (a
bf16 engine, bf16-rounded published weights), other kernels, other batching. The behaviour
log-probs a sample carries are the engine's; the objective's ratio ``pi_theta / pi_behaviour``
divides the trainer's by them, so any gap between the two on *identical* weights is noise in every
ratio, which M2PO's second-moment mask or PPO's clip then spends its budget on, and which grows
with response length (it compounds per token).

It can only be measured on tokens the trainer holds the sampling weights of: those whose version is
the version of the weights a step starts from (``trainer_version``). A stale token's gap mixes the
mismatch with the policy's own drift since it was sampled, so it is left out; on-policy runs
(``max_staleness: 0``) measure every token, stale ones only their freshest share. The measure is
exact when the WeightPublisher publishes every step (``every_n_steps: 1``, the default); with
more steps per version it includes the drift of the steps since that version was published.
:meth:`astralight.policy.RLPolicy.accumulate_gradients` calls :func:`mismatch_metrics` on the
first update of every step and logs the result as ``train/mismatch_*``.

With ``d = logp_trainer - logp_behaviour`` per measured token:

- ``mismatch_abs_mean``: mean ``|d|`` (nats per token);
- ``mismatch_k3``: mean ``exp(d) - 1 - d``, Schulman's k3 estimate of KL(behaviour || trainer)
  for tokens drawn by the behaviour policy (>= 0);
- ``mismatch_ratio_max`` / ``mismatch_ratio_min``: the extreme ``exp(d)``;
- ``mismatch_tail_fraction``: the share of tokens with ``exp(d)`` outside ``[1/2, 2]`` (the tail
  a truncated importance weight would cut);
- ``mismatch_tokens``: how many tokens were measured (0: none was on-policy, the rest absent).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from astralight.rl.kl import LOG_RATIO_CLAMP

#: ``|log r|`` above this counts in ``mismatch_tail_fraction`` (a ratio beyond 2x either way)
TAIL_LOG_RATIO = math.log(2.0)


def mismatch_metrics(logp: Tensor, logp_behaviour: Tensor, mask: Tensor, versions: Tensor,
                     version: int) -> dict[str, Tensor]:
    """The ``mismatch_*`` statistics (module docstring) over the loss-masked tokens sampled at
    ``version``, the version of the weights that computed ``logp`` (all ``[B, T-1]``, aligned);
    only ``mismatch_tokens`` (0) when there is none. Detached, float32."""
    measured = mask.bool() & (versions == int(version))
    count = int(measured.sum())
    out = {"mismatch_tokens": torch.tensor(float(count))}
    if count == 0:
        return out
    d = (logp.detach().float() - logp_behaviour.detach().float())[measured]
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(d)
    out.update({
        "mismatch_abs_mean": d.abs().mean(),
        "mismatch_k3": (ratio - 1.0 - d).mean(),
        "mismatch_ratio_max": ratio.max(),
        "mismatch_ratio_min": ratio.min(),
        "mismatch_tail_fraction": (d.abs() > TAIL_LOG_RATIO).float().mean(),
    })
    return out
