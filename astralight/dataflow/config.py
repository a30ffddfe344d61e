"""Configuration of the dataflow service: one dataclass, parsed from YAML + CLI by jsonargparse.

``astralight dataflow serve --config dataflow.yaml --port 8401`` ends up here. The config stays plain
data (plugins are ``{class_path, init_args}`` dicts) so it can be written back to YAML by tests and
launchers; :func:`instantiate_plugin` turns a spec into an object only when the service starts.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from jsonargparse import ActionConfigFile, ArgumentParser

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _default_source() -> dict:
    return {"class_path": "astralight.tasks.arithmetic.ArithmeticSource",
            "init_args": {"split": "train"}}


@dataclass
class EvalConfig:
    """Held-out evaluation: every ``every`` versions, ``k`` samples for each prompt of ``source``.

    Args:
        source: finite prompt source ``{class_path, init_args}``; null disables evals.
        every: evaluate versions that are multiples of this (version 0 included).
        k: samples per eval prompt (avg@k and pass@k).
    """

    source: Optional[dict] = None
    every: int = 5
    k: int = 4


@dataclass
class DataflowConfig:
    """Every knob of the dataflow service.

    Args:
        host: interface to bind; loopback by default (put a token and a proxy in front otherwise).
        port: TCP port (0 picks a free one; the ready line prints the real one).
        state_dir: holds the SQLite database and the weight store; reuse it to resume.
        model_ids: the policies served; every train task names all of them.
        workflow: workflow name written into each task for the RaaS.
        source: train prompt source ``{class_path, init_args}`` (a PromptSource).
        group_size: samples per train task (the group of the group-normalised advantage).
        lease_seconds: a leased task not pushed within this is re-issued.
        max_staleness: serve only samples at most this many versions behind the current one.
        queue_order: ``fifo`` (ingest order) or ``edf`` (oldest behaviour version first).
        max_buffered_samples: stop creating train tasks while every fresh queue plus what open
            tasks will deliver holds this many samples; also the largest pull size.
        max_inflight_tasks: at most this many open (unpushed) train tasks.
        eval: held-out evaluation schedule.
        max_body_bytes: largest msgpack request body.
        max_weight_file_bytes: largest uploaded weight file.
        seed: reserved for seeded data plugins; the service itself draws nothing at random
            (prompts come from the source, which has its own seed).
        batch_ack_timeout_s: a served batch not acked within this goes back into its queue.
        max_samples_per_rollout: a push holds at most n * len(model_ids) * this many samples.
        max_pull_timeout_s: upper bound on one long-poll pull.
        log_level: Python logging level of the service.
        weights_gc: garbage-collect old weight versions. Per model_id the store keeps the latest
            full version and every delta after it (all a newcomer needs), plus, for
            ``weights_keep_s`` seconds after a newer full version is published, the previous
            chain (a RaaS may be mid-way through downloading it). Older version folders and their
            manifests are removed, as are uploads of versions that can no longer be published.
        weights_keep_s: the grace period above, in seconds (0: collect as soon as a newer full
            version exists).
    """

    host: str = "127.0.0.1"
    port: int = 8400
    state_dir: str = "./dataflow_state"
    model_ids: list[str] = field(default_factory=lambda: ["policy"])
    workflow: str = "single_turn"
    source: dict = field(default_factory=_default_source)
    group_size: int = 8
    lease_seconds: float = 60.0
    max_staleness: int = 4
    queue_order: str = "fifo"
    max_buffered_samples: int = 512
    max_inflight_tasks: int = 64
    eval: EvalConfig = field(default_factory=EvalConfig)
    max_body_bytes: int = 16 * 1024 * 1024
    max_weight_file_bytes: int = 2 * 1024 * 1024 * 1024
    seed: int = 0
    batch_ack_timeout_s: float = 600.0
    max_samples_per_rollout: int = 32  # multi-turn rollouts emit one sample per turn
    max_pull_timeout_s: float = 300.0
    log_level: str = "INFO"
    weights_gc: bool = True
    weights_keep_s: float = 300.0

    def __post_init__(self) -> None:
        if isinstance(self.eval, dict):  # programmatic use: DataflowConfig(eval={...})
            self.eval = EvalConfig(**self.eval)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what would fix it."""
        if not self.model_ids or len(set(self.model_ids)) != len(self.model_ids):
            raise ValueError(f"model_ids: need a non-empty list of distinct names, got {self.model_ids}")
        for mid in self.model_ids:
            if not isinstance(mid, str) or not _NAME_RE.match(mid):
                raise ValueError(f"model_ids: {mid!r} must match {_NAME_RE.pattern}")
        if self.queue_order not in ("fifo", "edf"):
            raise ValueError(f"queue_order: must be 'fifo' or 'edf', got {self.queue_order!r}")
        positive = {"group_size": self.group_size, "lease_seconds": self.lease_seconds,
                    "max_buffered_samples": self.max_buffered_samples,
                    "max_inflight_tasks": self.max_inflight_tasks,
                    "max_body_bytes": self.max_body_bytes,
                    "max_weight_file_bytes": self.max_weight_file_bytes,
                    "batch_ack_timeout_s": self.batch_ack_timeout_s,
                    "max_samples_per_rollout": self.max_samples_per_rollout,
                    "eval.every": self.eval.every, "eval.k": self.eval.k}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if not self.weights_keep_s >= 0:
            raise ValueError(f"weights_keep_s: must be >= 0 seconds, got {self.weights_keep_s}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        for name, spec in (("source", self.source), ("eval.source", self.eval.source)):
            if spec is not None and (not isinstance(spec, dict) or "class_path" not in spec):
                raise ValueError(f"{name}: must be {{class_path: ..., init_args: {{...}}}}")

    def to_dict(self) -> dict:
        return asdict(self)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="astralight dataflow serve",
                            description="Run the astralight dataflow service.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_class_arguments(DataflowConfig)
    return parser


def parse_config(argv: list[str] | None = None) -> DataflowConfig:
    """Parse ``--config FILE`` plus CLI overrides (``--port 8401``, ``--eval.every 2``)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = ns.as_dict()
    values.pop("config", None)
    try:
        return DataflowConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def instantiate_plugin(spec: dict, base: type, name: str) -> Any:
    """Build the object a ``{class_path, init_args}`` spec names, checked against ``base``.

    jsonargparse validates the import path and the init args against the class signature, so a
    typo in YAML fails at start-up with a message naming ``name``.
    """
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--plugin", type=base)
    try:
        ns = parser.parse_object({"plugin": spec})
        return parser.instantiate(ns).plugin
    except Exception as exc:
        raise ValueError(f"{name}: cannot build {spec.get('class_path')!r}: {exc}") from exc
