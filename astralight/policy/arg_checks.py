"""The checks of :class:`astralight.policy.RLPolicy`'s scalar arguments, each error naming the
argument and what it accepts: a policy class without an objective, and out-of-range numbers."""

from __future__ import annotations


def check_init_args(cls: type, *, temperature: float, micro_batch_size: int | None,
                    minibatches: int, batch_passes: int, kl_coef: float, kl_decay_steps: int,
                    entropy_coef: float, unlikelihood_coef: float) -> None:
    """Raise ``TypeError`` for a class that does not implement ``compute_loss``, ``ValueError``
    naming the first argument out of range."""
    if getattr(cls.compute_loss, "_rl_policy_abstract", False):
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} does not implement compute_loss(batch, logp) "
            "-> (loss, metrics): RLPolicy is a base class with no objective. Define "
            "compute_loss in your subclass (see the astralight.policy docstring and "
            "examples/custom_trainer/reinforce.py), or use astralight.policy.M2POPolicy")
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: must be >= 1 or None, got {micro_batch_size}")
    for name, value in (("minibatches", minibatches), ("batch_passes", batch_passes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1 (1: one optimizer update per "
                             f"batch), got {value!r}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef: must be >= 0, got {kl_coef}")
    if isinstance(kl_decay_steps, bool) or not isinstance(kl_decay_steps, int) \
            or kl_decay_steps < 0:
        raise ValueError(f"kl_decay_steps: must be an integer >= 0 (0: a constant kl_coef), "
                         f"got {kl_decay_steps!r}")
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef: must be >= 0 (a bonus on entropy), got {entropy_coef}")
    if not unlikelihood_coef >= 0:  # also refuses NaN
        raise ValueError(f"unlikelihood_coef: must be >= 0 (0: off), got {unlikelihood_coef}")
