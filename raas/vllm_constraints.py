"""``SamplingSpec.constraint`` as vLLM's structured outputs, and vLLM's refusals of a
constrained request as :class:`~astralight.engine.ConstraintError`.

A constraint (a JSON schema, any JSON object, an xgrammar structural tag) runs on the engine's
structured-outputs backend (``"auto"``: xgrammar, falling back to guidance or outlines for what
xgrammar refuses; ``engine_kwargs={"structured_outputs_config": {...}}`` chooses another, or
compact JSON). The log-probs stay exact: vLLM 0.32 applies the grammar's token bitmask to the
logits (``-inf`` where the grammar forbids a token; ``apply_grammar_bitmask`` in the model
runner's ``sample_tokens``) before its sampler applies temperature and top-p and computes the
processed log-probs, so they are the log-probs of the constrained, renormalised distribution the
token was drawn from (a token that is the only one allowed gets 0). A schema or tag vLLM
refuses, or whose grammar fails to compile, fails the request with ``ConstraintError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from astralight.engine import ConstraintError

__all__ = ["structured_outputs", "constraint_error"]


def structured_outputs(constraint: Mapping[str, Any] | None) -> Any:
    """vLLM's ``StructuredOutputsParams`` for a ``SamplingSpec.constraint`` (None: none)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    kind, value = next(iter(constraint.items()))
    if kind == "json_schema":
        return StructuredOutputsParams(json=value)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=json.dumps(value))
    raise ValueError(f"constraint: unknown kind {kind!r}")


def constraint_error(exc: Exception) -> Exception:
    """vLLM's refusal of a constrained request as a :class:`ConstraintError`; anything else
    unchanged. What vLLM validates of our requests besides the constraint (prompt length, token
    ids, log-probs) the engine and the endpoint have checked before, so a refusal here is the
    schema's or the tag's; vLLM's own message says which."""
    from vllm.exceptions import VLLMValidationError

    if isinstance(exc, (VLLMValidationError, ValueError)):
        why = str(exc)
        if exc.__cause__ is not None:  # e.g. "Invalid structural tag specification." from ...
            why += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
        return ConstraintError(f"vLLM refused this constrained request: {why[:800]}")
    return exc
