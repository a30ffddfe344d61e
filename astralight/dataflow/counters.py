"""The dataflow's counters: a closed, declared set of names, checked on every increment.

Counters are persisted per ``model_id`` (in total and per policy version) and are the second
ledger the audit and the balance report read. A name outside :data:`COUNTERS` and the agent
counters (:data:`astralight.agents.stats.COUNTER_NAMES`) is a programming error: refusing it
keeps a typo from silently starting a new counter that no report reads.
"""

from __future__ import annotations

from astralight.agents.stats import COUNTER_NAMES as AGENT_COUNTERS

#: per-model_id counters (persisted in SQLite); stats report all of them, zero when never bumped
COUNTERS = ("tasks_issued", "tasks_reissued", "eval_tasks_issued", "eval_tasks_reissued",
            "samples_accepted", "duplicates_ignored", "stale_dropped", "samples_served",
            "batches_served", "samples_acked", "batches_acked", "batches_requeued",
            "samples_requeued", "eval_samples_accepted", "eval_samples_ignored",
            "weight_versions_removed",
            # data algorithms
            "rollouts_generated", "prompts_submitted", "prompts_skipped", "prompts_forced",
            "groups_filtered", "samples_filtered", "replay_added", "replay_evicted",
            "replay_stale_dropped", "replay_exhausted", "replay_served", "samples_trained",
            # trainer timings reported with acks (balance report)
            "trainer_wait_ms", "trainer_step_ms", "trainer_steps_timed",
            # pool membership: tasks a RaaS handed back; lease->push time of finished eval tasks
            "tasks_returned", "eval_task_ms",
            # batch keep-alives; acks of batches already re-queued (a trainer frozen past
            # batch_ack_timeout_s), those whose samples had been served again meanwhile, and
            # the samples those trained a second time (what the audit reports as duplicates)
            "batches_extended", "late_acks", "late_acks_after_reserve", "samples_trained_twice",
            # acked batches whose training a trainer's restart from an older checkpoint undid
            "batches_rolled_back", "samples_rolled_back")

#: every name a counter may have: the dataflow's own and the agent episodes' (tool calls)
KNOWN = frozenset(COUNTERS) | frozenset(AGENT_COUNTERS)


def check_counter(name: str) -> str:
    """Return ``name`` if it is a declared counter; raise ``ValueError`` naming it otherwise."""
    if name not in KNOWN:
        raise ValueError(f"unknown counter {name!r}: declare it in "
                         "astralight.dataflow.counters.COUNTERS before counting it")
    return name
