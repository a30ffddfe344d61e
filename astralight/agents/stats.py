"""Agent episode counts: tool calls and failed calls by kind, read from sample metadata.

The tool workflows write ``tool_calls`` (calls run) and ``tool_errors`` (``{kind: n}`` over
:data:`ERROR_KINDS`) into every sample's metadata, and ``end``: an episode whose agent raised or
timed out (:data:`FAILURE_KINDS`) is counted as failed. The dataflow counts them per policy version
(:func:`episode_counts`, shown in the balance report's ``agent`` section) and the trainer logs
their batch means as ``agent/*`` TensorBoard scalars (:func:`batch_scalars`). Pure Python, so the
dataflow can import it without the agent dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

#: every kind of failed tool call, counted per episode and reported
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout")

#: how an episode's agent failed (metadata ``end``; the openai_agent workflow scores such an
#: episode ``failed_reward`` on the calls it made)
FAILURE_KINDS = ("error", "timeout")

#: the dataflow's per-version counters these counts go to
COUNTER_NAMES = ("agent_episodes", "tool_episodes", "tool_calls",
                 *(f"tool_errors_{k}" for k in ERROR_KINDS),
                 *(f"agent_failed_{k}" for k in FAILURE_KINDS))


@dataclass
class ToolStats:
    """One episode's tool counts: calls made, and failed calls by kind."""

    calls: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))

    def add(self, error: str | None) -> None:
        """Count one call; ``error`` is its failure kind (None: it worked)."""
        if error is not None and error not in ERROR_KINDS:
            raise ValueError(f"error: unknown kind {error!r}; kinds: {ERROR_KINDS}")
        self.calls += 1
        if error is not None:
            self.errors[error] += 1

    def as_metadata(self) -> dict:
        return {"tool_calls": self.calls, "tool_errors": dict(self.errors)}


def _count(value) -> int | None:
    """A count from metadata: a non-negative int, else None (another workflow's own key)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def tool_calls_of(metadata: dict | None) -> int | None:
    """The episode's tool-call count a sample's metadata states (None: not a tool workflow)."""
    return _count(metadata.get("tool_calls")) if metadata else None


def counts_tools(metadata: dict | None) -> bool:
    """Whether a sample's metadata holds a tool workflow's episode counts (once per episode:
    the later segments of an episode split into several samples do not count again)."""
    return (bool(metadata) and _count(metadata.get("tool_calls")) is not None
            and not metadata.get("segment"))


def episode_counts(metadata: dict | None) -> dict[str, int]:
    """The counters one sample adds (empty for a sample of a workflow without tools)."""
    if not counts_tools(metadata):
        return {}
    calls = metadata["tool_calls"]
    out = {"agent_episodes": 1, "tool_episodes": int(calls > 0), "tool_calls": calls}
    errors = metadata.get("tool_errors") or {}
    if not isinstance(errors, dict):
        errors = {}
    for kind in ERROR_KINDS:
        out[f"tool_errors_{kind}"] = _count(errors.get(kind, 0)) or 0
    for kind in FAILURE_KINDS:
        out[f"agent_failed_{kind}"] = int(metadata.get("end") == kind)
    return out


def window_section(sums: dict[str, int]) -> dict | None:
    """The balance report's ``agent`` section from summed counters (None without episodes)."""
    episodes = int(sums.get("agent_episodes", 0))
    if episodes == 0:
        return None
    calls = int(sums.get("tool_calls", 0))
    return {"episodes": episodes,
            "tool_call_rate": round(sums.get("tool_episodes", 0) / episodes, 4),
            "tool_calls_per_episode": round(calls / episodes, 4),
            "tool_errors": {k: int(sums.get(f"tool_errors_{k}", 0)) for k in ERROR_KINDS},
            "agents_failed": {k: int(sums.get(f"agent_failed_{k}", 0)) for k in FAILURE_KINDS}}


def invalid_actions_of(metadata: dict | None) -> int | None:
    """The commands of an environment episode that the game did not accept (its outcome's
    ``invalid_actions``, e.g. :class:`~astralight.envs.textworld_env.TextWorldEnv`'s, which
    :class:`~astralight.workflows.chat_env.ChatEnvWorkflow` puts in ``metadata["env"]``); None
    for a sample without one."""
    env = metadata.get("env") if metadata else None
    return _count(env.get("invalid_actions")) if isinstance(env, dict) else None


def batch_scalars(metadatas: Iterable[dict | None]) -> dict[str, float]:
    """Per-sample means for the trainer's scalars (empty when no sample comes from a tool
    workflow): ``tool_call_rate`` (share of episodes with a call), ``tool_calls``, ``turns``,
    and ``tool_errors/<kind>`` (failed calls of that kind per episode); for environment
    episodes that count them (:func:`invalid_actions_of`), ``invalid_actions``: commands the
    game did not accept per episode (over ``turns``, the share of commands that were invalid)."""
    counted = [m for m in metadatas if counts_tools(m)]
    rows = [episode_counts(m) | {"turns": _count((m or {}).get("turns")) or 0} for m in counted]
    if not rows:
        return {}
    invalid = [invalid_actions_of(m) for m in counted]
    n = len(rows)
    out = {"tool_call_rate": sum(r["tool_episodes"] for r in rows) / n,
           "tool_calls": sum(r["tool_calls"] for r in rows) / n,
           "turns": sum(r["turns"] for r in rows) / n}
    for kind in ERROR_KINDS:
        out[f"tool_errors/{kind}"] = sum(r[f"tool_errors_{kind}"] for r in rows) / n
    for kind in FAILURE_KINDS:
        out[f"agent_failed/{kind}"] = sum(r[f"agent_failed_{kind}"] for r in rows) / n
    if any(v is not None for v in invalid):
        out["invalid_actions"] = sum(v or 0 for v in invalid) / n
    return out
