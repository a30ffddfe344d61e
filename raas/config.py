"""RaaS configuration: command line and YAML, parsed by jsonargparse.

    astralight raas serve --dataflow http://127.0.0.1:8400 --config raas.yaml

YAML keys (defaults in brackets)::

    engines:                      # one engine per policy this RaaS serves
      policy:                     # model_id -> VLLMEngine arguments ...
        model_path: ./model
        dtype: auto               # [auto] bf16 on CUDA and on CPUs that multiply it natively, else float32
        max_model_len: 128
        kv_cache_memory_bytes: 268435456
      # ... or another engine class: {class_path: astralight.raas.hf_engine.HFEngine, init_args: {...}}
    model_ids: [policy]           # [keys of engines] what to register for; an engine not
                                  # listed is frozen: served at its own weights, never synced
    workflow:                     # [SingleTurnWorkflow with ExactMatchReward]
      class_path: astralight.workflows.single_turn.SingleTurnWorkflow
      init_args:
        reward: {class_path: astralight.rewards.toy.ExactMatchReward}
        sampling: {temperature: 1.0, max_tokens: 8}
    max_concurrency: 64           # episodes (leased tasks) in flight at once; the capacity
                                  # registered. Each is its own asyncio task; a freed slot is
                                  # leased again at once
    poll_interval_s: 0.5          # an empty lease waits up to this long for room (long poll)
    seed: 0                       # engines without their own seed get seed + index
    weight_check_interval_s: 2.0, background_weight_sync: true,
    progress_interval_s: 10.0, heartbeat_interval_s: null (= lease_seconds / 3),
    instance_id: null, token: null (or env ASTRALIGHT_TOKEN), max_cycles: null (stop after this
    many lease calls and finish the episodes in flight),
    dataflow_give_up_s: 600 (exit 1 when every dataflow call has failed for this long),
    push_concurrency: 8 (push requests in flight at once, each carrying every finished task
    that is ready; hides a far dataflow's round-trip time),
    weight_download_dir: null (a temporary folder), weight_stream_min_bytes: 67108864
    (weight files at least this large are streamed to disk, not held in memory),
    held_weights_report: null (at shutdown, write JSON checksums of the weights each engine
    holds, read back from the engine, next to its manifest's; for audits and tests),
    capacity_units: 1.0 (what this instance is worth in GPUs or CPU slots, sent at registration;
    the balance report divides throughput by it and the autoscaler sums it),
    cycle_delay_s: 0.0 (every episode that generated something sleeps this long before it
    pushes: a deliberately slower instance, to run heterogeneous pools on identical hardware),
    drain_timeout_s: 120 (a drain -- SIGTERM, SIGINT or the dataflow's drain route -- that has not
    finished its episodes after this long becomes a hard stop: in-flight tasks are returned)

Engine options that shape concurrency live in each engine's entry (``VLLMEngine``):
``inflight_updates: keep | abort`` (what a weight update does to requests in flight) and
``torch_compile`` (vLLM's compiled sampler helper; default off on CPU, where tracing it cost
every start seconds).

Stopping: the first SIGTERM / SIGINT (or a drain asked by the dataflow through the heartbeat)
drains: no more leasing, the episodes in flight finish and push, the instance deregisters and
the process exits 0. A second signal (or drain_timeout_s) is a hard stop: every episode is
cancelled (its engine requests aborted), every in-flight task is returned, the instance
deregisters and the process exits 130 at once.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Optional

from astralight.workflows.base import Workflow

DEFAULT_ENGINE = "astralight.raas.vllm_engine.VLLMEngine"
DEFAULT_WORKFLOW = {
    "class_path": "astralight.workflows.single_turn.SingleTurnWorkflow",
    "init_args": {"reward": {"class_path": "astralight.rewards.toy.ExactMatchReward"}},
}


@dataclass
class RaaSConfig:
    """Everything the service needs, validated; ``workflow`` is already instantiated."""

    dataflow: str
    engines: dict[str, dict]
    workflow: Workflow
    model_ids: list[str] = field(default_factory=list)
    max_concurrency: int = 64
    poll_interval_s: float = 0.5
    seed: int = 0
    weight_check_interval_s: float = 2.0
    background_weight_sync: bool = True
    progress_interval_s: float = 10.0
    heartbeat_interval_s: Optional[float] = None
    instance_id: Optional[str] = None
    token: Optional[str] = None
    max_cycles: Optional[int] = None
    dataflow_give_up_s: float = 600.0
    push_concurrency: int = 8
    weight_download_dir: Optional[str] = None
    weight_stream_min_bytes: int = 64 << 20
    held_weights_report: Optional[str] = None
    concurrent_cycles: Optional[int] = None  # removed; validate() says what replaces it
    capacity_units: float = 1.0
    cycle_delay_s: float = 0.0
    drain_timeout_s: float = 120.0


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser

    p = ArgumentParser(prog="astralight raas serve",
                       description="Rollout-as-a-service: lease tasks, generate, push samples.")
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with the keys below")
    p.add_argument("--dataflow", type=str, default="http://127.0.0.1:8400",
                   help="URL of the dataflow service")
    p.add_argument("--token", type=Optional[str], default=None,
                   help="bearer token (default: env ASTRALIGHT_TOKEN)")
    p.add_argument("--engines", type=dict[str, dict[str, Any]], default={},
                   help="{model_id: VLLMEngine kwargs, or {class_path, init_args}}")
    p.add_argument("--model_ids", type=Optional[list[str]], default=None,
                   help="policies to register for (default: the keys of engines); an engine "
                        "not listed is served frozen: built, never synced or registered (a "
                        "model an agent team calls but does not train)")
    p.add_argument("--workflow", type=Optional[Workflow], default=None,
                   help="workflow plugin {class_path, init_args} (default: single turn, exact match)")
    p.add_argument("--max_concurrency", type=int, default=64)
    p.add_argument("--poll_interval_s", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight_check_interval_s", type=float, default=2.0)
    p.add_argument("--background_weight_sync", type=bool, default=True)
    p.add_argument("--progress_interval_s", type=float, default=10.0)
    p.add_argument("--heartbeat_interval_s", type=Optional[float], default=None)
    p.add_argument("--instance_id", type=Optional[str], default=None)
    p.add_argument("--max_cycles", type=Optional[int], default=None,
                   help="stop after this many lease calls, then finish the episodes in flight "
                        "(benchmarks, tests)")
    p.add_argument("--dataflow_give_up_s", type=float, default=600.0,
                   help="exit 1 when the dataflow has failed every call for this long")
    p.add_argument("--push_concurrency", type=int, default=8,
                   help="pushes in flight at once (hides the round-trip time of a far dataflow)")
    p.add_argument("--weight_download_dir", type=Optional[str], default=None,
                   help="where large weight files are streamed to (default: a temporary folder)")
    p.add_argument("--weight_stream_min_bytes", type=int, default=64 << 20,
                   help="weight files at least this large are streamed to disk")
    p.add_argument("--held_weights_report", type=Optional[str], default=None,
                   help="at shutdown, write JSON checksums of the weights each engine holds")
    p.add_argument("--concurrent_cycles", type=Optional[int], default=None,
                   help="removed: every leased task is its own episode (max_concurrency bounds "
                        "them); setting it is an error that says so")
    p.add_argument("--capacity_units", type=float, default=1.0,
                   help="GPUs or CPU slots this instance stands for (sent at registration)")
    p.add_argument("--cycle_delay_s", type=float, default=0.0,
                   help="every episode sleeps this long before pushing (a slower instance)")
    p.add_argument("--drain_timeout_s", type=float, default=120.0,
                   help="a drain still running after this long becomes a hard stop")
    return p


def parse_config(argv: list[str] | None = None) -> RaaSConfig:
    """Parse ``argv`` (and the YAML it names) into a validated :class:`RaaSConfig`."""
    parser = build_parser()
    cfg = parser.parse_args(argv)
    if cfg.workflow is None:
        cfg.workflow = DEFAULT_WORKFLOW
    cfg = parser.instantiate_classes(cfg)
    values = {k: v for k, v in vars(cfg).items() if k not in ("config", "__path__")}
    config = RaaSConfig(**{k: values[k] for k in RaaSConfig.__dataclass_fields__ if k in values})
    if not config.model_ids:
        config.model_ids = list(config.engines)
    validate(config)
    return config


def validate(config: RaaSConfig) -> None:
    if not config.engines:
        raise ValueError("engines: configure at least one engine, e.g. "
                         "engines: {policy: {model_path: ./model}}")
    missing = [m for m in config.model_ids if m not in config.engines]
    if missing:
        raise ValueError(f"model_ids: {missing} have no entry in engines ({sorted(config.engines)})")
    for mid, spec in config.engines.items():
        if not isinstance(spec, dict):
            raise ValueError(f"engines.{mid}: expected a mapping of engine arguments")
        if "class_path" not in spec and "model_path" not in spec:
            raise ValueError(f"engines.{mid}.model_path: is required")
        check_engine_spec(mid, spec)
    if config.max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {config.max_concurrency}")
    if config.poll_interval_s < 0:
        raise ValueError("poll_interval_s: must be >= 0")
    if config.concurrent_cycles is not None:
        raise ValueError("concurrent_cycles: removed -- every leased task now runs as its own "
                         "episode, up to max_concurrency in flight, and the engine batches them "
                         "all; delete the key (set max_concurrency to the episodes you want in "
                         "flight)")
    if config.push_concurrency < 1:
        raise ValueError(f"push_concurrency: must be >= 1, got {config.push_concurrency}")
    if not config.capacity_units > 0:
        raise ValueError(f"capacity_units: must be > 0 (GPUs or CPU slots), got "
                         f"{config.capacity_units}")
    if config.cycle_delay_s < 0:
        raise ValueError(f"cycle_delay_s: must be >= 0, got {config.cycle_delay_s}")
    if not config.drain_timeout_s > 0:
        raise ValueError(f"drain_timeout_s: must be > 0, got {config.drain_timeout_s}")
    if config.weight_stream_min_bytes < 0:
        raise ValueError("weight_stream_min_bytes: must be >= 0 (0 streams every file to disk)")


def import_object(path: str) -> Any:
    """``"package.module.Name"`` -> the object; a clear error naming the path if it is wrong."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"class_path: cannot import {path!r} ({exc})") from None


def _engine_class_and_kwargs(model_id: str, spec: dict) -> tuple[Any, dict]:
    spec = dict(spec)
    if "class_path" in spec:
        cls = import_object(spec.pop("class_path"))
        kwargs = dict(spec.pop("init_args", {}) or {})
        if spec:
            raise ValueError(f"engines.{model_id}: unexpected keys {sorted(spec)} next to class_path")
        return cls, kwargs
    return import_object(DEFAULT_ENGINE), spec


def check_engine_spec(model_id: str, spec: dict) -> None:
    """Check one engine's arguments before anything starts: every key is a parameter of the
    engine class (a typo such as ``max_model_length`` names the key and the closest parameter),
    and a local ``model_path`` (:func:`astralight.trainer.hf_models.is_local_path`: absolute, ``./``,
    ``../``, ``~`` or ``a/b/c``) exists. A hub id (``org/name``) is left to the engine. Raises ValueError naming ``engines.<model_id>.<key>``."""
    import difflib
    import inspect

    from astralight.trainer.hf_models import check_model_path

    cls, kwargs = _engine_class_and_kwargs(model_id, spec)
    where = f"engines.{model_id}" + (".init_args" if "class_path" in spec else "")
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = [n for n in params if n != "self"]
        for key in kwargs:
            if key not in params:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"{where}.{key}: {cls.__name__} has no argument {key!r}; "
                                 f"{hint}it takes {', '.join(sorted(accepted))}")
    check_model_path(kwargs.get("model_path"), f"{where}.model_path")


def build_engine(model_id: str, spec: dict, seed: int) -> Any:
    """Instantiate the engine of one policy: VLLMEngine(**spec) or {class_path, init_args}."""
    cls, kwargs = _engine_class_and_kwargs(model_id, spec)
    kwargs.setdefault("seed", seed)
    return cls(**kwargs)
