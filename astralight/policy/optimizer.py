"""The policy's optimizer and learning-rate schedule.

By default AdamW with linear warm-up, then constant; an ``optimizer`` / ``lr_scheduler`` spec
(``{class_path, init_args}``, from ``astralight fit --optimizer ... --lr_scheduler ...`` or the
trainer YAML) replaces either. :func:`check_class_spec` checks a spec when the module is built,
so a typo fails before the model loads, not at the first step.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch


def check_class_spec(spec: Any, key: str, base: type) -> dict | None:
    """Check a ``{class_path, init_args}`` spec of a ``base`` subclass (``optimizer``,
    ``lr_scheduler``) when the module is built, not at the first step; returns it normalised
    (a bare class path string is accepted). The error names the key and the fix."""
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise ValueError(f"{key}: expected {{class_path: ..., init_args: {{...}}}} naming a "
                         f"{base.__module__}.{base.__qualname__} subclass, got {spec!r}")
    unknown = set(spec) - {"class_path", "init_args"}
    if unknown:
        raise ValueError(f"{key}: unknown keys {sorted(unknown)}; only class_path and init_args")
    init_args = dict(spec.get("init_args") or {})
    path = spec["class_path"]
    module_name, _, name = path.rpartition(".")
    example = ("torch.optim.lr_scheduler.CosineAnnealingLR" if key == "lr_scheduler"
               else "torch.optim.SGD")
    try:
        klass = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{key}.class_path: cannot import {path!r} ({exc}); name a class by "
                         f"its full import path, e.g. {example}") from None
    if not (isinstance(klass, type) and issubclass(klass, base)):
        raise ValueError(f"{key}.class_path: {path!r} is not a {base.__module__}."
                         f"{base.__qualname__} subclass; name one, e.g. {example}")
    if issubclass(klass, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(f"{key}.class_path: {path!r} needs a monitored metric, and the policy "
                         "steps its scheduler once per optimizer step without one; name a "
                         f"step-driven scheduler, e.g. {example}")
    return {"class_path": path, "init_args": init_args}


def _build(spec: dict, first):
    """``class_path(first, **init_args)`` of a spec checked by :func:`check_class_spec`."""
    module_name, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module_name), name)(first, **spec["init_args"])


def build_optimizers(params: list[torch.nn.Parameter], *, optimizer_spec: dict | None,
                     lr_scheduler_spec: dict | None, lr: float, betas: tuple[float, float],
                     weight_decay: float, warmup_steps: int) -> dict:
    """What ``configure_optimizers`` returns: the optimizer over ``params`` and its schedule,
    stepped once per optimizer step (``interval: step``).

    ``optimizer_spec`` replaces AdamW (``lr``, ``betas``, ``weight_decay``): it is built over the
    same parameters with its own ``init_args``. ``lr_scheduler_spec`` replaces the
    ``warmup_steps`` of linear warm-up; ``T_max`` / ``total_iters`` there count optimizer steps.
    """
    if optimizer_spec is not None:
        opt = _build(optimizer_spec, params)
    else:
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if lr_scheduler_spec is not None:
        sched = _build(lr_scheduler_spec, opt)
    else:
        warmup = max(0, int(warmup_steps))

        def factor(step: int) -> float:
            return 1.0 if warmup == 0 else min(1.0, (step + 1) / warmup)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
