"""``M2POPolicy``: the shipped objective, an :class:`~astralight.policy.RLPolicy` with M2PO.

M2PO (the paper's second-moment token selection), its released variant (``m2po_harmful``, an
adaptive clip of harmful tokens), PPO-clip, or PPO-clip with a truncated importance weight on the
behaviour policy (``tis_ppo``); the losses themselves are :mod:`astralight.rl.m2po` and
:mod:`astralight.rl.ppo`, this module binds them to the policy's extension points.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

from astralight.policy.base import RLPolicy
from astralight.rl.m2po import m2_harmful_clip, m2po_harmful_loss, m2po_keep_mask, m2po_loss
from astralight.rl.ppo import ppo_clip_loss, truncated_is_ppo_loss

#: the objectives ``M2POPolicy(loss=...)`` knows
LOSSES = ("m2po", "m2po_harmful", "ppo_clip", "tis_ppo")


class M2POPolicy(RLPolicy):
    """Trains one policy with M2PO (or its released variant, or PPO-clip) on dataflow batches.

    An :class:`RLPolicy` whose :meth:`compute_loss` is M2PO; :meth:`loss_context` adds the
    whole-batch M2 selection (or the harmful-token clip range).

    Args:
        model_path: Hugging Face model folder (the same folder the RaaS starts from: version 0).
        model_id: the policy this trainer owns; batches of another ``model_id`` are refused.
        loss: ``"m2po"`` (paper, the default), ``"m2po_harmful"`` (released code's variant),
            ``"ppo_clip"``, or ``"tis_ppo"``: PPO-clip against the trainer's own log-probs times
            a truncated importance weight ``min(pi_trainer / pi_behaviour, is_cap)`` on the
            sampler (:func:`astralight.rl.ppo.truncated_is_ppo_loss`), the correction peers
            ship for a train/inference mismatch (``train/mismatch_*`` measures it). M2PO needs
            none: its ratio is to the behaviour log-probs themselves, and its second-moment
            mask drops the tokens a mismatch pushes furthest.
        m2_threshold: M2PO's second-moment budget on ``(log r)^2`` (paper default 0.04).
        clip_eps: PPO clip range (``ppo_clip`` only); ``clip_eps_high``: DAPO clip-higher bound.
        harmful_min_eps_low / harmful_min_eps_high: floors on the adaptive clip range of
            ``m2po_harmful`` (the released code's ``miniclip_low/high``; unset in its scripts).
        is_cap: ``tis_ppo``'s cap on the behaviour importance weight (2.0, as verl's
            ``rollout_is_threshold``).
        **kwargs: every other :class:`RLPolicy` argument (``kl_coef``, ``temperature``, ``lr``,
            ``micro_batch_size``, ``lora``, ``optimizer``, ...), passed on unchanged;
            ``astralight fit --model.help astralight.policy.M2POPolicy`` lists them all.
    """

    def __init__(
        self,
        model_path: str,
        model_id: str = "policy",
        loss: Literal["m2po", "m2po_harmful", "ppo_clip", "tis_ppo"] = "m2po",
        m2_threshold: float = 0.04,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        harmful_min_eps_low: float | None = None,
        harmful_min_eps_high: float | None = None,
        is_cap: float = 2.0,
        **kwargs: Any,
    ):
        if loss not in LOSSES:
            raise ValueError(f"loss: {loss!r} is not one of {LOSSES}")
        if not is_cap >= 1.0:
            raise ValueError(f"is_cap: {is_cap!r} must be >= 1 (a weight cap below 1 would "
                             "down-weight every token); verl and slime use 2.0")
        super().__init__(model_path=model_path, model_id=model_id, **kwargs)
        self.loss_name = loss
        self.m2_threshold = m2_threshold
        self.clip_eps = clip_eps
        self.clip_eps_high = clip_eps_high
        self.harmful_min_eps_low = harmful_min_eps_low
        self.harmful_min_eps_high = harmful_min_eps_high
        self.is_cap = float(is_cap)

    def loss_context(self, batch: dict, logp: Tensor) -> dict[str, Any]:
        """The base context plus, per objective, the M2 keep mask (``m2_keep``,
        ``m2_selection``, all-gathered over ranks), the harmful clip (``harmful_clip``) or the
        trainer's own log-probs at the update's start (``logp_proximal``, ``tis_ppo``)."""
        ctx = super().loss_context(batch, logp)
        mask = batch["mask"]
        if self.loss_name == "m2po":
            keep, sel = m2po_keep_mask(logp, batch["logp_behaviour"], mask, self.m2_threshold)
            ctx["m2_keep"] = keep
            ctx["m2_selection"] = sel
        elif self.loss_name == "m2po_harmful":
            ctx["harmful_clip"] = m2_harmful_clip(
                logp, batch["logp_behaviour"], batch["advantages"], mask, self.m2_threshold,
                self.harmful_min_eps_low, self.harmful_min_eps_high)
        elif self.loss_name == "tis_ppo":
            ctx["logp_proximal"] = logp.detach()
        return ctx

    def compute_loss(self, batch: dict, logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """M2PO / M2PO-harmful / PPO-clip / TIS-PPO on one (micro-)batch, token-mean over
        ``n_tokens``."""
        mask, n_tokens = batch["mask"], batch["n_tokens"]
        if self.loss_name == "m2po":
            loss, metrics = m2po_loss(
                logp, batch["logp_behaviour"], batch["advantages"], mask, self.m2_threshold,
                keep=batch["m2_keep"], n_tokens=n_tokens, selection=batch["m2_selection"])
            # ``m2`` (this micro-batch's mean (log r)^2) repeats ``m2_before`` (the same over the
            # whole batch, the statistic the selection uses): one tag, not two
            metrics.pop("m2", None)
            return loss, metrics
        if self.loss_name == "m2po_harmful":
            return m2po_harmful_loss(
                logp, batch["logp_behaviour"], batch["advantages"], mask, self.m2_threshold,
                clip=batch["harmful_clip"], n_tokens=n_tokens)
        if self.loss_name == "tis_ppo":
            return truncated_is_ppo_loss(
                logp, batch["logp_proximal"], batch["logp_behaviour"], batch["advantages"], mask,
                self.clip_eps, self.clip_eps_high, self.is_cap, n_tokens=n_tokens)
        return ppo_clip_loss(
            logp, batch["logp_behaviour"], batch["advantages"], mask, self.clip_eps,
            self.clip_eps_high, n_tokens=n_tokens)
