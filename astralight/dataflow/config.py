"""Configuration of the dataflow service: one dataclass, parsed from YAML + CLI by jsonargparse.

``astralight dataflow serve --config dataflow.yaml --port 8401`` ends up here. The config stays plain
data (plugins are ``{class_path, init_args}`` dicts) so it can be written back to YAML by tests and
launchers; :func:`instantiate_plugin` turns a spec into an object only when the service starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from jsonargparse import ActionConfigFile, ArgumentParser

from astralight.dataflow.plugins import normalize_spec
from astralight.protocol import MAX_VOCAB_SIZE

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _default_source() -> dict:
    return {"class_path": "astralight.tasks.arithmetic.ArithmeticSource",
            "init_args": {"split": "train"}}


@dataclass
class EvalConfig:
    """Held-out evaluation: every ``every`` versions, ``n`` samples for each prompt of ``source``.

    Args:
        source: finite prompt source ``{class_path, init_args}``; null disables evals.
        every: evaluate versions that are multiples of this (version 0 included).
        k: the k of the headline avg@k and pass@k (``avg_at_k`` / ``pass_at_k`` of the results);
            also the samples per eval prompt unless ``n`` is set.
        n: samples per eval prompt (null: ``k``). pass@k for every k <= n comes from these n
            samples with the unbiased estimator ``1 - C(n-c, k) / C(n, k)``, so one run with
            ``n: 8`` reports pass@1, pass@4 and pass@8; avg@k is the mean reward of all n.
        pass_k: the k values to report pass@k for (null: ``[k]``; ``k`` is always included).
            Each must be <= ``n``.
    """

    source: Optional[dict] = None
    every: int = 5
    k: int = 4
    n: Optional[int] = None
    pass_k: Optional[list[int]] = None

    def samples(self) -> int:
        """Samples drawn per eval prompt: ``n``, or ``k`` when ``n`` is not set."""
        return self.n if self.n is not None else self.k

    def pass_ks(self) -> list[int]:
        """The k values pass@k is reported for, ascending, ``k`` included."""
        return sorted(set(self.pass_k or []) | {self.k})

    def validate(self) -> None:
        """Raise ValueError naming the bad ``eval.*`` field and the fix."""
        if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int)
                                   or self.n < 1):
            raise ValueError(f"eval.n: must be a positive number of samples per eval prompt "
                             f"(or null for eval.k), got {self.n!r}")
        n = self.samples()
        if self.k > n:
            raise ValueError(f"eval.k: {self.k} exceeds eval.n={n} samples per eval prompt; "
                             f"avg@k / pass@k need at least k samples: raise eval.n to >= "
                             f"{self.k} or lower eval.k")
        for j in self.pass_k or []:
            if isinstance(j, bool) or not isinstance(j, int) or j < 1:
                raise ValueError(f"eval.pass_k: every k must be a positive int, got {j!r}")
            if j > n:
                raise ValueError(f"eval.pass_k: k={j} exceeds eval.n={n} samples per eval "
                                 f"prompt (pass@k needs at least k samples); set eval.n to >= "
                                 f"{j} or drop {j} from eval.pass_k")


def _default_selectors() -> list:
    return ["uniform"]


@dataclass
class ReplayConfig:
    """Replay at batch serving: a ``ratio`` share of every batch comes from samples trained before.

    A fresh sample enters its policy's replay pool when the batch that carried it is acknowledged.
    Args:
        ratio: share of each batch drawn from the pool (0 disables replay; < 1: every batch keeps
            fresh samples). When the pool holds fewer eligible samples, fresh ones fill the batch.
        max_staleness: never replay a sample whose oldest token is more than this many versions
            behind the policy's current version (checked at serve time, drops counted).
        pool_size: samples kept per policy; the oldest are evicted (counted) beyond it.
        max_uses: a sample leaves the pool after being replayed this many times (0: no limit).
        selectors: replay selectors in order (``latest``, ``uniform``, ``high_variance`` or
            ``{class_path, init_args}``); each narrows or reorders the candidates of the previous,
            the batch takes the first ones of the last.
    """

    ratio: float = 0.0
    max_staleness: int = 4
    pool_size: int = 4096
    max_uses: int = 0
    selectors: list[Union[str, dict]] = field(default_factory=_default_selectors)


@dataclass
class DataflowConfig:
    """Every knob of the dataflow service.

    Args:
        host: interface to bind; loopback by default. Any other address needs a bearer token
            (``ASTRALIGHT_TOKEN``, or the scoped ``ASTRALIGHT_ROLLOUT_TOKEN`` /
            ``ASTRALIGHT_TRAINER_TOKEN`` / ``ASTRALIGHT_ADMIN_TOKEN``, in the service's
            environment; :mod:`astralight.dataflow.auth`) of at least 16 bytes: the service
            refuses to start without one unless ``allow_insecure_public_bind`` is true.
        port: TCP port (0 picks a free one; the ready line prints the real one).
        allow_insecure_public_bind: serve on a non-loopback ``host`` without a token (anyone who
            reaches the port may then lease, push and publish). Only for a network you fully
            trust; logged as a warning at start.
        tls_certfile: PEM certificate (chain) to serve HTTPS with (cross-region links); needs
            ``tls_keyfile``. Clients then use an ``https://`` URL and trust the issuing CA
            (``DataflowClient(ca_file=...)`` or ``ASTRALIGHT_CA_FILE``).
        tls_keyfile: PEM private key of ``tls_certfile``.
        max_clients_tracked: client addresses (and, separately, instance ids) whose requests and
            failures ``/v1/stats`` keeps (``clients``, ``client_instances``); least recently seen
            forgotten first.
        header_timeout_s: a connection must send its complete request head (request line and
            headers) within this many seconds of connecting, or of the end of its previous
            response; else it is closed (a 408 naming this key if it sent part of one), so
            stalled or half-sent connections cannot pile up. A request whose head has arrived is
            never cut short by it (long polls, slow uploads). Raise it only for clients on links
            so slow that a few hundred bytes take longer. See
            :mod:`astralight.dataflow.http_connections`.
        max_connections: open connections the service holds at most. At the limit a new
            connection first closes the one that has waited longest for a request head
            (stalled or idle); only when every connection is busy with a request is the new one
            refused (clients retry). A run's trainers, RaaS instances and monitors use tens;
            the process needs about this many plus 128 file descriptors (``ulimit -n``: the
            service raises its soft limit; below that, the hard limit lowers this one, with a
            warning at start). Timeouts, evictions and refusals are logged once per episode,
            with counts.
        state_dir: holds the SQLite database and the weight store; reuse it to resume.
        integrity_check_s: at start, ``PRAGMA quick_check`` of the state's database stops after
            this many seconds (it reads the whole file: about as long as reading it from disk);
            its size, time and outcome are logged, and a damaged database stops the service
            with one line naming ``state_dir``. 0: skip the check.
        allow_lost_commits: start on a state whose database holds fewer committed transactions
            than the count kept outside SQLite (``state_dir/dataflow.commits``: its WAL was
            deleted or damaged, or dataflow.db was replaced by an older copy). Off: the service
            refuses to start and says so. On: it goes on from what is left and records the
            loss, which the audit then reports (the state never balances again).
        model_ids: the policies served; every train task names all of them.
        workflow: workflow name written into each task for the RaaS.
        source: train prompt source ``{class_path, init_args}`` (a PromptSource).
        group_size: samples per train task (the group of the group-normalised advantage).
        advantage_scale: ``"std"`` (GRPO: ``(r - mean) / (std + eps)`` per group) or
            ``"none"`` (Dr. GRPO: ``r - mean``, no division by the group's std, which
            up-weights groups whose rewards barely differ).
        failed_group_advantage: the advantage of every sample of a train group in which all
            failed (its rewards all equal and not above 0), instead of GRPO's 0; in [-1, 0].
            A negative value (e.g. -0.1) pushes down what the group tried, so probability moves
            to answers no sample has tried yet (negative sample reinforcement): on a task where
            most groups find nothing, they stop being wasted. A ``zero_advantage`` sample
            filter drops such groups before they are trained, so the two do not combine.
        lease_seconds: a leased task not pushed within this is re-issued (and counts as a
            failure of the instance that held it). Also the membership clock: an instance silent
            for half of it is ``suspect``, for all of it ``gone``.
        suspect_failures: an instance whose last this many tasks failed (expired leases, tasks
            returned as failed) is ``suspect`` and leases one task at a time (a probe) until a
            push succeeds.
        slow_factor: an instance whose mean lease->push time exceeds this many times the pool
            median (both over at least 3 tasks) is slow: it holds at most
            ``max(1, ceil(capacity / ratio))`` tasks at once.
        max_staleness: serve only samples at most this many versions behind the current one.
        queue_order: serving order of the fresh queues: ``fifo`` (ingest order), ``edf`` (oldest
            behaviour version first), ``freshest`` (newest behaviour version first), a list of queue-order plugins composed lexicographically
            (``[edf, fifo]``, ``{class_path, init_args}``), or a mapping ``{model_id: order}`` for a
            different order per policy (policies not named get ``fifo``).
        curators: prompt curators (pre-rollout hook) in order: ``accept_all``, ``filter_solved``,
            ``greso`` or ``{class_path, init_args}``. A prompt becomes a task only if every
            curator accepts it; every curator learns every outcome. Empty: accept all.
        curator_max_skips: safety valve: after this many consecutive rejected prompts the next
            one is submitted anyway (counted as ``prompts_forced``); 0 means one pass over the
            source, at most 10000 (procedural sources are endless).
        sample_filters: sample filters (post-rollout hook) in order: ``keep_all``,
            ``zero_advantage`` (dynamic sampling), ``length`` or ``{class_path, init_args}``.
            Filtered samples stay in SQLite (state ``filtered``) and are counted.
        replay: replay at batch serving (see :class:`ReplayConfig`).
        mode: ``async`` (default: rollout never waits for training; staleness is bounded by
            ``max_staleness``) or ``sync``, the colocated-style baseline for measuring against:
            round v starts when every policy has published version v; it creates tasks (stamped
            ``min_versions``, so a RaaS first loads version v) until each policy has
            ``sync_batch_size`` accepted samples generated by version v; the trainers train on
            exactly that batch and publish v+1. Samples of an older round are dropped (counted
            as ``stale_dropped``).
        sync_batch_size: samples per policy per round in ``sync`` mode (the trainers'
            ``batch_size``).
        plugin_state_every_s: persist the data plugins' state (with their random generators) at
            least this often, besides at every published version of the primary policy
            (``model_ids[0]``) and at shutdown.
        max_buffered_samples: stop creating train tasks while every fresh queue plus what open
            tasks will deliver holds this many samples; also the largest pull size.
        max_inflight_tasks: at most this many open (unpushed) train tasks.
        lease_demand_versions: size what the RaaS generate to what the trainers consume: a new
            train task is created for a policy only while its queued samples plus what the open
            train tasks will deliver (``group_size`` each, times the share the sample filters
            keep) stay under this many versions of its trainers' consumption (measured over the
            last 4 versions: batches served per version times fresh samples per batch; before
            that ``trainer_samples_per_version``), and never below the largest batch pulled. More
            would be dropped stale before it could be served. 0 (default): off (only
            ``max_inflight_tasks`` and ``max_buffered_samples``); null: ``max_staleness + 1``;
            otherwise >= 1. Off by default because the autoscaler's scale-down signal is the
            share of accepted samples the trainers consume: with the cap on, an oversized pool
            is throttled instead of overproducing, and that share stays near 1 (it would never
            scale down). Applies on top of those two caps, so a
            config whose caps are already tighter sees no change. Async mode only (sync mode
            sizes each round by ``sync_batch_size``). See :mod:`astralight.dataflow.demand`.
        trainer_samples_per_version: ``{model_id: fresh samples its trainers take per version}``
            (``batch_size`` x data-parallel ranks x ``every_n_steps``, less the replayed share),
            the demand used before one version has been measured, so the first version's leases
            are sized too. Policies not named get no demand cap until then.
        eval: held-out evaluation schedule.
        max_body_bytes: largest msgpack request body (also of a batched push: a client splits
            a ``push_many`` the service refuses as too big).
        max_weight_file_bytes: largest uploaded weight file.
        seed: seeds every data plugin's random generator (each plugin gets its own stream,
            derived from this seed and its place in the config); prompts come from the source,
            which has its own seed.
        batch_ack_timeout_s: a served batch neither acked nor extended (``POST
            /v1/batches/extend``) within this goes back into its queue and may be served again.
            Sent to trainers with every pull; the datamodule extends each batch it holds every
            third of it, so a long step keeps its batch and only a dead or frozen trainer (or
            one cut off from the dataflow) loses it.
        max_samples_per_rollout: a push holds at most n * len(model_ids) * this many samples.
        vocab_sizes: ``{model_id: vocabulary size}``; a pushed sample with a token id outside
            ``[0, size)`` is refused (it would crash the trainer's embedding lookup). The
            launcher fills it from each trainer's ``model_path/config.json``. Without it the
            vocabulary a RaaS registered for its engine is used (``POST /v1/register``
            ``limits``; a registration that disagrees with this setting is refused), and with
            neither only ids below ``astralight.protocol.MAX_VOCAB_SIZE`` (2^24) pass. The
            engines' registered ``max_model_len`` bounds a sample's length the same way (no
            config).
        temperatures: ``{model_id: sampling temperature}``: the policy module's ``temperature``
            (``model.init_args.temperature``). A pushed train sample whose
            ``metadata.temperature`` differs is refused on ingest with the trainer's own check
            (``astralight.protocol.temperature_mismatch``), so it cannot stop the trainer later.
            Policies not named: any finite temperature > 0 passes and the trainer checks it.
        max_version_jump: a published version (and an upload for it) may be at most this many
            versions above the policy's current one. A WeightPublisher that falls behind skips
            the snapshots it replaced (one version per ``every_n_steps`` optimizer steps spent
            on one publication: a few), so the default leaves a wide margin, while one manifest
            with a huge version (a bug, a hostile client: 2^53-1 would make every later
            publish 409 and every queued sample stale, for good) is refused. Raise it for a
            trainer resumed from a checkpoint far ahead of this state folder.
        max_pull_timeout_s: upper bound on one long poll (a pull's ``timeout_s``, a lease's
            ``wait_s``).
        log_level: Python logging level of the service.
        weights_gc: garbage-collect old weight versions. Per model_id the store keeps the latest
            full version and every delta after it (all a newcomer needs), plus, for
            ``weights_keep_s`` seconds after a newer full version is published, the previous
            chain (a RaaS may be mid-way through downloading it). Older version folders and their
            manifests are removed, as are uploads of versions that can no longer be published.
        weights_keep_s: the grace period above, in seconds (0: collect as soon as a newer full
            version exists).
        group_commit: make commits durable in groups: SQLite commits without an fsync and one
            fsync of its WAL covers every commit made meanwhile, so concurrent pushes share it;
            every request is still answered only once its commits are on disk
            (:mod:`astralight.dataflow.durability`). false: SQLite fsyncs inside every commit,
            under the service lock (one fsync per request).
    """

    host: str = "127.0.0.1"
    port: int = 8400
    allow_insecure_public_bind: bool = False
    tls_certfile: Optional[str] = None
    tls_keyfile: Optional[str] = None
    max_clients_tracked: int = 1024
    header_timeout_s: float = 10.0
    max_connections: int = 512
    state_dir: str = "./dataflow_state"
    integrity_check_s: float = 60.0
    allow_lost_commits: bool = False
    model_ids: list[str] = field(default_factory=lambda: ["policy"])
    workflow: str = "single_turn"
    source: dict = field(default_factory=_default_source)
    group_size: int = 8
    advantage_scale: str = "std"
    failed_group_advantage: float = 0.0
    lease_seconds: float = 60.0
    suspect_failures: int = 3
    slow_factor: float = 3.0
    max_staleness: int = 4
    queue_order: Union[str, list[Union[str, dict]], dict[str, Union[str, list[Union[str, dict]]]]] = "fifo"
    max_buffered_samples: int = 512
    max_inflight_tasks: int = 64
    lease_demand_versions: Optional[float] = 0.0
    trainer_samples_per_version: dict[str, int] = field(default_factory=dict)
    eval: EvalConfig = field(default_factory=EvalConfig)
    max_body_bytes: int = 16 * 1024 * 1024
    max_weight_file_bytes: int = 2 * 1024 * 1024 * 1024
    seed: int = 0
    batch_ack_timeout_s: float = 600.0
    max_samples_per_rollout: int = 32  # multi-turn rollouts emit one sample per turn
    vocab_sizes: dict[str, int] = field(default_factory=dict)
    temperatures: dict[str, float] = field(default_factory=dict)
    max_version_jump: int = 1000
    max_pull_timeout_s: float = 300.0
    log_level: str = "INFO"
    weights_gc: bool = True
    weights_keep_s: float = 300.0
    curators: list[Union[str, dict]] = field(default_factory=list)
    curator_max_skips: int = 0
    sample_filters: list[Union[str, dict]] = field(default_factory=list)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    plugin_state_every_s: float = 10.0
    mode: str = "async"
    sync_batch_size: int = 0
    group_commit: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.eval, dict):  # programmatic use: DataflowConfig(eval={...})
            self.eval = EvalConfig(**self.eval)
        if isinstance(self.replay, dict):
            self.replay = ReplayConfig(**self.replay)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what would fix it."""
        if not self.model_ids or len(set(self.model_ids)) != len(self.model_ids):
            raise ValueError(f"model_ids: need a non-empty list of distinct names, got {self.model_ids}")
        for mid in self.model_ids:
            if not isinstance(mid, str) or not _NAME_RE.match(mid):
                raise ValueError(f"model_ids: {mid!r} must match {_NAME_RE.pattern}")
        self.queue_order_specs()  # raises naming the bad entry
        for name, specs in self.plugin_lists().items():
            if not isinstance(specs, list):
                raise ValueError(f"{name}: must be a list of plugin specs, got {specs!r}")
            for i, spec in enumerate(specs):
                normalize_spec(spec, f"{name}[{i}]")
        rp = self.replay
        if not 0.0 <= rp.ratio < 1.0:
            raise ValueError(f"replay.ratio: must be in [0, 1) (a share of each batch), got {rp.ratio}")
        if rp.max_staleness < 0:
            raise ValueError(f"replay.max_staleness: must be >= 0, got {rp.max_staleness}")
        if rp.pool_size < 1:
            raise ValueError(f"replay.pool_size: must be >= 1, got {rp.pool_size}")
        if rp.max_uses < 0:
            raise ValueError(f"replay.max_uses: must be >= 0 (0: no limit), got {rp.max_uses}")
        if rp.ratio > 0 and not rp.selectors:
            raise ValueError("replay.selectors: replay is on (ratio > 0) but no selector is "
                             "configured; use [uniform]")
        if self.advantage_scale not in ("std", "none"):
            raise ValueError(f"advantage_scale: must be 'std' (GRPO) or 'none' (Dr. GRPO: r - "
                             f"mean), got {self.advantage_scale!r}")
        if not -1.0 <= self.failed_group_advantage <= 0.0:  # also refuses NaN
            raise ValueError("failed_group_advantage: must be in [-1, 0] (0: GRPO, a failed "
                             "group teaches nothing; negative: push down what it tried), got "
                             f"{self.failed_group_advantage!r}; a positive value would "
                             "reinforce failures")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode: must be 'async' or 'sync', got {self.mode!r}")
        if self.mode == "sync" and self.sync_batch_size < 1:
            raise ValueError("sync_batch_size: sync mode needs the trainers' batch size "
                             f"(samples per policy per round), got {self.sync_batch_size}")
        if self.mode == "sync" and self.sync_batch_size > self.max_buffered_samples:
            raise ValueError(f"sync_batch_size: {self.sync_batch_size} exceeds "
                             f"max_buffered_samples={self.max_buffered_samples}; raise that")
        if self.suspect_failures < 1:
            raise ValueError(f"suspect_failures: must be >= 1 failed tasks, got {self.suspect_failures}")
        if not self.slow_factor >= 1.0:
            raise ValueError(f"slow_factor: must be >= 1 (times the pool median task time), got "
                             f"{self.slow_factor}")
        if self.curator_max_skips < 0:
            raise ValueError(f"curator_max_skips: must be >= 0 (0: one pass over the source), "
                             f"got {self.curator_max_skips}")
        if not self.plugin_state_every_s > 0:
            raise ValueError(f"plugin_state_every_s: must be > 0, got {self.plugin_state_every_s}")
        if not self.integrity_check_s >= 0:  # (also refuses NaN)
            raise ValueError(f"integrity_check_s: must be >= 0 seconds (0: no start-up check), "
                             f"got {self.integrity_check_s}")
        positive = {"group_size": self.group_size, "lease_seconds": self.lease_seconds,
                    "max_buffered_samples": self.max_buffered_samples,
                    "max_inflight_tasks": self.max_inflight_tasks,
                    "max_body_bytes": self.max_body_bytes,
                    "max_weight_file_bytes": self.max_weight_file_bytes,
                    "batch_ack_timeout_s": self.batch_ack_timeout_s,
                    "max_samples_per_rollout": self.max_samples_per_rollout,
                    "header_timeout_s": self.header_timeout_s,
                    "max_connections": self.max_connections,
                    "eval.every": self.eval.every, "eval.k": self.eval.k}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        self.eval.validate()
        if bool(self.tls_certfile) != bool(self.tls_keyfile):
            raise ValueError("tls_certfile, tls_keyfile: set both (PEM certificate and its private "
                             f"key) or neither; got certfile={self.tls_certfile!r}, "
                             f"keyfile={self.tls_keyfile!r}")
        for mid, size in self.vocab_sizes.items():
            if mid not in self.model_ids:
                raise ValueError(f"vocab_sizes: {mid!r} is not one of model_ids {self.model_ids}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"vocab_sizes.{mid}: must be a positive int, got {size!r}")
            if size > MAX_VOCAB_SIZE:
                raise ValueError(f"vocab_sizes.{mid}: {size} exceeds {MAX_VOCAB_SIZE} (no "
                                 "tokenizer is that large); give the model's vocab_size")
        for mid, t in self.temperatures.items():
            if mid not in self.model_ids:
                raise ValueError(f"temperatures: {mid!r} is not one of model_ids {self.model_ids}")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                    math.isfinite(t) and t > 0):
                raise ValueError(f"temperatures.{mid}: must be the policy's sampling temperature "
                                 f"(a finite number > 0), got {t!r}")
        if (isinstance(self.max_version_jump, bool) or not isinstance(self.max_version_jump, int)
                or self.max_version_jump < 1):
            raise ValueError(f"max_version_jump: must be an int >= 1 (versions a publication may "
                             f"skip ahead), got {self.max_version_jump!r}")
        if self.max_clients_tracked < 1:
            raise ValueError(f"max_clients_tracked: must be >= 1, got {self.max_clients_tracked}")
        if not self.weights_keep_s >= 0:
            raise ValueError(f"weights_keep_s: must be >= 0 seconds, got {self.weights_keep_s}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        self._validate_lease_demand()
        for name, spec in (("source", self.source), ("eval.source", self.eval.source)):
            if spec is not None and (not isinstance(spec, dict) or "class_path" not in spec):
                raise ValueError(f"{name}: must be {{class_path: ..., init_args: {{...}}}}")

    def _validate_lease_demand(self) -> None:
        """Raise ValueError naming ``lease_demand_versions`` / ``trainer_samples_per_version``."""
        v = self.lease_demand_versions
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or (v != 0 and v < 1)):
            raise ValueError(f"lease_demand_versions: must be null (max_staleness + 1), 0 (off) or "
                             f">= 1 version of the trainers' consumption, got {v!r}; below 1 the "
                             "fresh queue could never hold a whole version's batches")
        for mid, n in self.trainer_samples_per_version.items():
            if mid not in self.model_ids:
                raise ValueError(f"trainer_samples_per_version: {mid!r} is not one of model_ids "
                                 f"{self.model_ids}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"trainer_samples_per_version.{mid}: must be a positive number of "
                                 f"samples per version (batch_size x ranks x every_n_steps), "
                                 f"got {n!r}")

    def demand_versions(self) -> float:
        """Versions of consumption the lease route lets be outstanding (0: no demand cap)."""
        if self.lease_demand_versions is None:
            return float(self.max_staleness + 1)
        return float(self.lease_demand_versions)

    def to_dict(self) -> dict:
        return asdict(self)

    def plugin_lists(self) -> dict[str, list]:
        """The plugin lists that apply to the whole service, by config key."""
        return {"curators": self.curators, "sample_filters": self.sample_filters,
                "replay.selectors": self.replay.selectors}

    def queue_order_specs(self) -> dict[str, list[dict]]:
        """Normalised queue-order plugin specs per model_id (see ``queue_order``)."""
        order = self.queue_order
        if isinstance(order, dict):
            unknown = sorted(set(order) - set(self.model_ids))
            if unknown:
                raise ValueError(f"queue_order: {unknown} are not in model_ids {self.model_ids}")
            per_model = {m: order.get(m, "fifo") for m in self.model_ids}
        else:
            per_model = {m: order for m in self.model_ids}
        out = {}
        for m, spec in per_model.items():
            name = f"queue_order.{m}" if isinstance(order, dict) else "queue_order"
            specs = spec if isinstance(spec, list) else [spec]
            if not specs:
                raise ValueError(f"{name}: an empty list; use fifo or edf")
            out[m] = [normalize_spec(s, f"{name}[{i}]" if isinstance(spec, list) else name)
                      for i, s in enumerate(specs)]
        return out


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="astralight dataflow serve",
                            description="Run the astralight dataflow service.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_class_arguments(DataflowConfig)
    return parser


def parse_config(argv: list[str] | None = None) -> DataflowConfig:
    """Parse ``--config FILE`` plus CLI overrides (``--port 8401``, ``--eval.every 2``).

    A ``class_path`` that cannot be imported exits 2 with a message naming its key (jsonargparse
    lets the ``AttributeError`` of ``pkg.no_such_module.Class`` escape as a traceback)."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except (ImportError, AttributeError) as exc:
        where = _unimportable_class_path(_config_files(argv))
        parser.error(f"{where[0]}: cannot import {where[1]!r} ({where[2]}); check the module "
                     "path, and that its package is installed or on PYTHONPATH" if where else
                     f"a class_path in the config cannot be imported: {exc}")
        raise  # unreachable: parser.error exits
    values = ns.as_dict()
    values.pop("config", None)
    try:
        return DataflowConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _config_files(argv: list[str] | None) -> list[str]:
    """The ``--config`` files of a command line, in order."""
    argv, out = list(argv or ()), []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith("--config="):
            out.append(arg.split("=", 1)[1])
    return out


def _unimportable_class_path(files: list[str]) -> tuple[str, str, str] | None:
    """``(key, class_path, error)`` of the first ``class_path`` in the YAML ``files`` that
    cannot be imported, e.g. ``("source.class_path", "pkg.nope.Cls", "...")``; None if all can."""
    import importlib

    import yaml

    def walk(node: Any, key: str):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from walk(v, f"{key}[{i}]")
        elif key.endswith("class_path") and isinstance(node, str):
            yield key, node

    for path in files:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        for key, class_path in walk(data, ""):
            module, _, name = class_path.rpartition(".")
            try:
                getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as exc:
                return key, class_path, f"{type(exc).__name__}: {exc}"
    return None


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


def build_plugins(config: DataflowConfig) -> dict[str, Any]:
    """Instantiate every data plugin of ``config``; a bad spec fails naming its place.

    Returns ``{"curators": [...], "sample_filters": [...], "replay.selectors": [...],
    "queue_order": {model_id: [...]}}``, each object checked against its base class.
    """
    from astralight.dataflow.curators import PromptCurator
    from astralight.dataflow.queues import QueueOrder
    from astralight.dataflow.replay import ReplaySelector
    from astralight.dataflow.sample_filters import SampleFilter

    bases = {"curators": PromptCurator, "sample_filters": SampleFilter,
             "replay.selectors": ReplaySelector}
    out: dict[str, Any] = {}
    for key, specs in config.plugin_lists().items():
        out[key] = [instantiate_plugin(normalize_spec(s, f"{key}[{i}]"), bases[key], f"{key}[{i}]")
                    for i, s in enumerate(specs)]
    out["queue_order"] = {
        m: [instantiate_plugin(s, QueueOrder, f"queue_order.{m}[{i}]") for i, s in enumerate(specs)]
        for m, specs in config.queue_order_specs().items()}
    return out
