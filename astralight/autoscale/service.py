"""``astralight autoscale``: keep a pool of rollout services sized to what the trainer consumes.

    astralight autoscale --dataflow http://127.0.0.1:8400 --raas-config raas.yaml \\
        --model-id policy --min 1 --max 4 --initial 1 --every 10 --cooldown-s 120
    astralight autoscale --dataflow URL --model-id policy --min 1 --max 8 --backend command \\
        --launch-cmd "sbatch --job-name={instance} raas.sbatch {instance}" \\
        --retire-cmd "scancel --name={instance}"

The loop (every ``--poll-s``): read ``/v1/stats`` (the policy's current version and the instance
table); notice instances it started that exited (and replace them if the pool fell below
``--min``); every ``--every`` versions read the balance report over those versions
(``/v1/balance/{model_id}?window=every&pool=G``, G = the pool it counts: its own running
instances plus live ones it did not start) and apply :class:`~astralight.autoscale.policy.Policy`
(bounds, cooldown, retirement order); act through the backend. Each decision is one line on
stdout and one JSON line in the decisions log. SIGTERM / SIGINT: retire (drain) every instance it
started, wait until each has deregistered (the dataflow's table) or exited (the backend) -- at
most ``--shutdown-grace-s`` -- and exit 0; a second signal stops them with SIGTERM at
once. Waiting matters under a command backend: the retire command (``scancel --signal=TERM``)
returns at once, and whatever stops after the autoscaler (the dataflow) must outlive the drains.

The autoscaler holds no state the dataflow does not. Restarted (after a crash, kill -9, a
preemption) while instances a previous run of it started are still registered -- under a command
backend (Slurm, Kubernetes) they outlive it on purpose; local instances die with it (parent-death
signal, :mod:`astralight.launch.proc`) but one may linger until it deregisters -- it **adopts** them
instead of starting a second pool: every live instance of the dataflow's table whose id is
``<id_prefix>-<k>`` and that serves ``model_id`` counts as its own (managed: retirable, drained on
shutdown), at start before the initial launch (which then starts only the shortfall) and on every
poll after (a job queued before the crash may register late). Instance ids continue after the
decisions log's and the adopted ones, so a restart does not reuse a name. Adopted instances are
retired through the backend when it can name them (command templates) and through the drain route
otherwise (a local instance that is not this process's child). Two autoscalers on one dataflow
must use different ``--id-prefix`` values (or different model ids).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from astralight.autoscale.backends import BackendError, CommandBackend, LocalProcessBackend
from astralight.autoscale.policy import LEAVING, LIVE, Decision, Policy, PolicyConfig, pool_members

log = logging.getLogger("astralight.autoscale")


@dataclass
class AutoscaleConfig:
    """The loop's settings (the policy's are in :class:`PolicyConfig`)."""

    model_id: str = "policy"
    every: int = 10
    initial: int | None = None          # instances started at once (default: min_instances)
    poll_s: float = 2.0
    id_prefix: str = "auto"
    decisions_log: str | None = None
    start_grace_s: float = 300.0        # backends that cannot tell liveness: a launched instance
                                        # counts this long before it must show in the table
    give_up_s: float = 600.0            # exit 1 when the dataflow has failed for this long
    shutdown_grace_s: float = 120.0     # on stop, wait at most this long for retired instances

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every: must be a positive number of versions, got {self.every!r}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0 seconds, got {self.poll_s!r}")
        if self.initial is not None and (not isinstance(self.initial, int) or self.initial < 0):
            raise ValueError(f"initial: must be an int >= 0, got {self.initial!r}")


class Autoscaler:
    """The loop; ``client`` is a DataflowClient (``stats``, ``balance``, ``drain``), ``backend``
    a :class:`~astralight.autoscale.backends.Backend`. ``clock`` (monotonic, for the cooldown and
    the shutdown wait's deadline), ``sleep`` (the shutdown wait's pause between polls; it must
    advance ``clock``) and ``wall`` (epoch seconds, comparable with the dataflow's timestamps)
    are injectable."""

    def __init__(self, policy: Policy, backend: Any, client: Any, config: AutoscaleConfig,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 out=None, sleep: Callable[[float], Any] | None = None):
        if sleep is None and clock is not time.monotonic:
            raise ValueError("sleep: give the sleep that advances the injected clock (the "
                             "shutdown wait would never reach its deadline)")
        self.policy = policy
        self.backend = backend
        self.client = client
        self.config = config
        self.clock = clock
        self.wall = wall
        self.out = out or sys.stdout
        self.managed: dict[str, float] = {}    # running instances it started: id -> launched at
        self.retiring: dict[str, float] = {}   # being drained: id -> retirement began (wall)
        self.started: list[str] = []           # every instance it ever launched
        self.retired: list[str] = []           # instances whose retirement finished
        self.adopted: list[str] = []           # instances of an earlier run it took over
        self.decisions: list[dict] = []
        self.version = 0
        self.next_report = config.every
        self.sleep = sleep or time.sleep
        self._k = self._first_index()

    # ------------------------------------------------------------------ bookkeeping

    def _first_index(self) -> int:
        """Continue instance numbering after the decisions log's, if there is one."""
        path = self.config.decisions_log
        k = 0
        if path and os.path.exists(path):
            prefix = f"{self.config.id_prefix}-"
            with open(path) as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue
                    for iid in (entry.get("launched") or []) + (entry.get("adopted") or []):
                        if iid.startswith(prefix) and iid[len(prefix):].isdigit():
                            k = max(k, int(iid[len(prefix):]) + 1)
        return k

    def _index(self, iid: str) -> int | None:
        """``k`` of an id ``<id_prefix>-<k>``, None for any other id."""
        prefix = f"{self.config.id_prefix}-"
        if iid.startswith(prefix) and iid[len(prefix):].isdigit():
            return int(iid[len(prefix):])
        return None

    def adopt(self, table: list[dict]) -> list[str]:
        """Take over live instances named like its own that it neither started nor adopted yet
        (a previous run's: see the module docstring); returns their ids, records the decision."""
        known = set(self.started) | set(self.adopted) | set(self.managed) | set(self.retiring)
        found = []
        for row in table:
            iid = str(row.get("instance_id"))
            k = self._index(iid)
            if k is None or iid in known:
                continue
            if row.get("status") not in LIVE or row.get("state") in LEAVING:
                continue
            if self.config.model_id not in (row.get("model_ids") or [self.config.model_id]):
                continue
            since = row.get("registered_at")
            self.managed[iid] = float(since) if since is not None else self.wall()
            self.adopted.append(iid)
            self._k = max(self._k, k + 1)
            found.append(iid)
        if found:
            pool = len(pool_members(table, self.managed, self.config.model_id))
            self.record(Decision("adopt", pool, pool, reason=(
                f"{', '.join(found)}: registered {self.config.id_prefix}-* instance(s) of an "
                "earlier run, now counted as its own")), adopted=found)
        return found

    def _retire(self, iid: str, n: int) -> None:
        """Retire a managed instance: through the backend if it can name it, else (an adopted
        local instance, not a child of this process) through the drain route."""
        if iid in self.adopted and not getattr(self.backend, "manages", lambda _i: True)(iid):
            self.client.drain(iid)
        else:
            self.backend.retire(iid, n=n)

    def say(self, line: str) -> None:
        print(f"[autoscale] {line}", file=self.out, flush=True)

    def record(self, decision: Decision, launched: list[str] | None = None,
               errors: list[str] | None = None, **extra: Any) -> dict:
        entry = {"time": round(self.wall(), 3), "version": self.version, **decision.to_dict(),
                 "launched": launched or [], "errors": errors or [], **extra}
        self.decisions.append(entry)
        text = f"v{self.version} {decision.line()}"
        if launched:
            text += f" | launched {', '.join(launched)}"
        if errors:
            text += f" | errors: {'; '.join(errors)}"
        self.say(text)
        if self.config.decisions_log:
            Path(self.config.decisions_log).parent.mkdir(parents=True, exist_ok=True)
            with open(self.config.decisions_log, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return entry

    # ------------------------------------------------------------------ acting

    def act(self, decision: Decision, **extra: Any) -> dict:
        """Carry out a decision through the backend and record it (``extra``: more fields of
        its record)."""
        launched, errors = [], []
        for _ in range(decision.launch):
            iid = f"{self.config.id_prefix}-{self._k}"
            self._k += 1
            try:
                self.backend.launch(iid, n=decision.target)
            except Exception as exc:
                errors.append(f"launch {iid}: {exc}")
                continue
            self.managed[iid] = self.wall()
            self.started.append(iid)
            launched.append(iid)
        for iid in decision.retire:
            try:
                if iid in self.managed:
                    self._retire(iid, decision.target)
                    self.managed.pop(iid, None)
                    self.retiring[iid] = self.wall()
                else:  # a live instance it did not start (retire_unmanaged): drain it only
                    self.client.drain(iid)
            except Exception as exc:
                errors.append(f"retire {iid}: {exc}")
        return self.record(decision, launched, errors, **extra)

    def start(self) -> None:
        """Adopt a previous run's registered instances, then launch the rest of the initial pool.

        When the instance table cannot be read, it launches the whole initial pool; instances of
        an earlier run are adopted on a later poll and the policy resizes the pool."""
        cfg = self.policy.config
        n = cfg.clamp(self.config.initial if self.config.initial is not None else cfg.min_instances)
        have = 0
        try:
            table = list(self.client.stats().get("instances") or [])
        except Exception as exc:
            self.say(f"could not read the instance table before the initial launch ({exc}); "
                     "an earlier run's instances, if any, are adopted on a later poll")
        else:
            if self.adopt(table):
                have = len([m for m in pool_members(table, self.managed, self.config.model_id)
                            if m.managed])
        launch = max(0, n - have)
        if launch:
            reason = f"initial pool (bounds {cfg.min_instances}..{cfg.max_instances})"
            if have:
                reason += f"; {have} adopted"
            self.act(Decision("initial", have, n, launch=launch, reason=reason))
            self.policy.acted(self.clock())

    def _alive(self, iid: str, rows: dict[str, dict]) -> bool:
        alive = self.backend.alive(iid)
        if alive is not None:
            return bool(alive)
        row = rows.get(iid)  # the backend cannot tell: judge from the dataflow's table
        if row is None:
            return self.wall() - self.managed.get(iid, self.wall()) < self.config.start_grace_s
        return row.get("status") != "gone" and row.get("state") != "left" and row.get("status") != "left"

    def reap(self, table: list[dict]) -> None:
        """Forget instances that exited: retirements that finished, and instances that died."""
        rows = {str(r.get("instance_id")): r for r in table}
        for iid in list(self.retiring):
            if self.backend.alive(iid) is not True:
                del self.retiring[iid]
                self.retired.append(iid)
        for iid in list(self.managed):
            if self._alive(iid, rows):
                continue
            launched_at = self.managed.pop(iid)
            code = getattr(self.backend, "returncode", lambda _i: None)(iid)
            pool = len(pool_members(table, self.managed, self.config.model_id))
            self.record(Decision("died", pool + 1, pool, reason=(
                f"{iid} exited (code {code}) {self.wall() - launched_at:.0f}s after launch "
                f"without being retired")), instance_id=iid, exit_code=code)

    def step(self) -> Decision | None:
        """One poll; returns the report-driven decision when a report was due."""
        now = self.clock()
        stats = self.client.stats()
        table = list(stats.get("instances") or [])
        model = (stats.get("models") or {}).get(self.config.model_id) or {}
        self.version = int(model.get("current_version") or 0)
        self.reap(table)
        self.adopt(table)
        members = pool_members(table, self.managed, self.config.model_id)
        bounded = self.policy.bounds(members, now)
        if bounded is not None:
            self.act(bounded)
            members = pool_members(table, self.managed, self.config.model_id)
        if self.version < self.next_report:
            return None
        report = self.client.balance(self.config.model_id, window=self.config.every,
                                     pool=len(members))
        members = pool_members(report.get("instances", table), self.managed, self.config.model_id)
        decision = self.policy.decide(report, members, self.clock())
        # the pool as the policy saw it: why these instances were retired
        self.act(decision, members=[{"instance_id": m.instance_id, "managed": m.managed,
                                     "status": m.status, "samples_per_s": round(m.samples_per_s, 3)}
                                    for m in members])
        every = self.config.every
        self.next_report = (self.version // every + 1) * every
        return decision

    def shutdown(self) -> None:
        """Retire (drain) every instance it started and still runs; wait for them."""
        ids = list(self.managed)
        if ids:
            self.act(Decision("shutdown", len(ids), 0, retire=ids,
                              reason="the autoscaler is stopping: retiring what it started"))
        try:
            self.backend.close()  # waits for the drains in progress
            self.wait_retired()
        finally:
            self.reap([])

    def _running(self, iid: str, rows: dict[str, dict] | None) -> bool:
        """Whether a retired instance has yet to finish: not once the dataflow's table shows it
        deregistered (left) or gone -- what the dataflow needed from it is done, even if its job
        still tears down -- else as the backend says, else while the table lists it."""
        row = (rows or {}).get(iid)
        if row is not None and (row.get("status") in ("gone", "left") or row.get("state") == "left"):
            return False
        alive = self.backend.alive(iid)
        if alive is not None:
            return bool(alive)
        return row is not None

    def wait_retired(self) -> list[str]:
        """Wait until every retiring instance has deregistered or exited, at most ``shutdown_grace_s``
        (polling every ``poll_s``); returns those still running at the deadline."""
        deadline = self.clock() + self.config.shutdown_grace_s
        while True:
            rows = None
            try:
                rows = {str(r.get("instance_id")): r
                        for r in self.client.stats().get("instances") or []}
            except Exception:  # noqa: BLE001 - the dataflow may be gone: the backend still tells
                pass
            left = [iid for iid in self.retiring if self._running(iid, rows)]
            if not left:
                return []
            if self.clock() >= deadline:
                self.say(f"shutdown: {', '.join(left)} still running after "
                         f"{self.config.shutdown_grace_s:.0f}s (--shutdown-grace-s); exiting")
                return left
            self.sleep(self.config.poll_s)

    def run(self, stop: threading.Event) -> int:
        """Start the pool, poll until ``stop`` is set, retire the pool; the exit code."""
        code = 0
        self.start()
        failing_since = None
        while not stop.is_set():
            try:
                self.step()
                failing_since = None
            except Exception as exc:
                now = self.clock()
                failing_since = failing_since or now
                log.warning("autoscaler poll failed: %s", exc)
                self.say(f"poll failed ({type(exc).__name__}: {exc})")
                if now - failing_since > self.config.give_up_s:
                    self.say(f"giving up: the dataflow has failed for {now - failing_since:.0f}s")
                    code = 1
                    break
            stop.wait(self.config.poll_s)
        self.shutdown()
        return code


# ---------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="astralight autoscale",
        description="Grow or shrink a pool of rollout services from the dataflow's balance report.")
    p.add_argument("--dataflow", default="http://127.0.0.1:8400", help="URL of the dataflow service")
    p.add_argument("--model-id", default="policy", help="the policy whose trainer the pool feeds")
    p.add_argument("--min", type=int, default=1, help="fewest instances (default 1)")
    p.add_argument("--max", type=int, default=4, help="most instances (default 4)")
    p.add_argument("--initial", type=int, default=None, help="instances at start (default --min)")
    p.add_argument("--every", type=int, default=10, help="versions between reports (default 10)")
    p.add_argument("--cooldown-s", type=float, default=120.0,
                   help="seconds after an action before the next (default 120)")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between polls (default 2)")
    p.add_argument("--backend", choices=("local", "command", "ray"), default="local",
                   help="local: RaaS processes on this machine (default); command: shell "
                        "templates; ray: Ray actors on a Ray cluster (the ray extra)")
    p.add_argument("--raas-config", default=None, help="RaaS config each local instance starts with")
    p.add_argument("--launch-cmd", default=None, help="command backend: start {instance} ({n} wanted)")
    p.add_argument("--retire-cmd", default=None, help="command backend: stop {instance} ({n} wanted)")
    p.add_argument("--alive-cmd", default=None,
                   help="command backend, optional: exits 0 while {instance} runs")
    p.add_argument("--log-dir", default="autoscale-logs",
                   help="local instances' logs, and the decisions log (default ./autoscale-logs)")
    p.add_argument("--decisions-log", default=None,
                   help="JSON lines, one per decision (default LOG_DIR/autoscale-decisions.jsonl)")
    p.add_argument("--drain-timeout-s", type=float, default=120.0,
                   help="local: SIGTERM a draining instance after this long (default 120)")
    p.add_argument("--kill-after-s", type=float, default=30.0,
                   help="local: SIGKILL this long after SIGTERM (default 30)")
    p.add_argument("--cpus", default=None, help="local: CPU list of the instances, e.g. 1 or 2,3")
    p.add_argument("--retire-unmanaged", action="store_true",
                   help="may also drain live instances it did not start")
    p.add_argument("--replace-backoff-s", type=float, default=10.0,
                   help="at most one replacement of died instances per this long (default 10)")
    p.add_argument("--id-prefix", default="auto", help="instance ids are PREFIX-<k> (default auto)")
    p.add_argument("--shutdown-grace-s", type=float, default=120.0,
                   help="on SIGTERM/SIGINT, wait at most this long for the retired instances to "
                        "exit (default 120)")
    p.add_argument("--ray-address", default=None,
                   help="ray: the cluster's address HOST:PORT (default RAY_ADDRESS or the "
                        "cluster `ray start` started on this machine)")
    p.add_argument("--ray-namespace", default="astralight", help="ray: the actors' namespace")
    p.add_argument("--ray-resources", default=None,
                   help='ray: each instance\'s resources as JSON (default {"num_gpus": 1, '
                        '"num_cpus": 1})')
    p.add_argument("--give-up-s", type=float, default=600.0,
                   help="exit 1 when the dataflow has been unreachable this long (default 600)")
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, naming the flag and the fix; None when usable."""
    if args.min < 0:
        return f"--min: must be >= 0, got {args.min}"
    if args.max < max(args.min, 1):
        return f"--max: must be >= --min ({args.min}) and >= 1, got {args.max}"
    if args.initial is not None and not args.min <= args.initial <= args.max:
        return f"--initial: must be within --min..--max ({args.min}..{args.max}), got {args.initial}"
    if args.every < 1:
        return f"--every: must be a positive number of versions, got {args.every}"
    for flag in ("cooldown_s", "poll_s", "drain_timeout_s", "kill_after_s", "replace_backoff_s",
                 "give_up_s", "shutdown_grace_s"):
        value = getattr(args, flag)
        if value < 0 or (flag == "poll_s" and value == 0):
            return f"--{flag.replace('_', '-')}: must be a positive number of seconds, got {value}"
    if args.backend in ("local", "ray"):
        if not args.raas_config:
            return (f"--raas-config: required with --backend {args.backend} (the RaaS config "
                    "each instance starts with)")
        if not Path(args.raas_config).is_file():
            return f"--raas-config: {args.raas_config} is not a file"
    else:
        for flag in ("launch_cmd", "retire_cmd"):
            if not getattr(args, flag):
                return (f"--{flag.replace('_', '-')}: required with --backend command "
                        "(a shell template with {instance} and {n})")
    if args.cpus:
        try:
            [int(c) for c in args.cpus.split(",")]
        except ValueError:
            return f"--cpus: must be a comma-separated list of CPU numbers, got {args.cpus!r}"
    return None


def make_backend(args: argparse.Namespace, say: Callable[[str], None]):
    if args.backend == "ray":  # astralight.autoscale.ray_backend: Ray imported only here
        return _ray_backend(args, say)
    if args.backend == "local":
        return LocalProcessBackend(args.raas_config, args.dataflow, args.log_dir,
                                   cpus=[int(c) for c in args.cpus.split(",")] if args.cpus else None,
                                   drain_timeout_s=args.drain_timeout_s,
                                   kill_after_s=args.kill_after_s, say=say)
    return CommandBackend(args.launch_cmd, args.retire_cmd, alive=args.alive_cmd,
                          dataflow_url=args.dataflow, say=say)


def _ray_backend(args: argparse.Namespace, say: Callable[[str], None]):
    """The Ray backend of ``--backend ray`` (BackendError for bad --ray-resources, or no Ray)."""
    from astralight.autoscale.ray_backend import RayBackend

    try:
        resources = json.loads(args.ray_resources) if args.ray_resources else None
    except ValueError as exc:
        raise BackendError(f"--ray-resources: not JSON ({exc}); e.g. "
                           '\'{"num_gpus": 1, "num_cpus": 4}\'') from None
    return RayBackend(args.raas_config, args.dataflow, args.log_dir, address=args.ray_address,
                      namespace=args.ray_namespace, resources=resources,
                      cpus=[int(c) for c in args.cpus.split(",")] if args.cpus else None,
                      drain_timeout_s=args.drain_timeout_s, kill_after_s=args.kill_after_s,
                      say=say)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``astralight autoscale``; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"astralight autoscale: {problem}", file=sys.stderr)
        return 2
    from astralight.dataflow.client import DataflowClient

    decisions_log = args.decisions_log or str(Path(args.log_dir) / "autoscale-decisions.jsonl")
    say = lambda line: print(f"[autoscale] {line}", flush=True)  # noqa: E731
    try:
        policy = Policy(PolicyConfig(min_instances=args.min, max_instances=args.max,
                                     cooldown_s=args.cooldown_s,
                                     retire_unmanaged=args.retire_unmanaged,
                                     replace_backoff_s=args.replace_backoff_s))
        config = AutoscaleConfig(model_id=args.model_id, every=args.every, initial=args.initial,
                                 poll_s=args.poll_s, id_prefix=args.id_prefix,
                                 decisions_log=decisions_log, give_up_s=args.give_up_s,
                                 shutdown_grace_s=args.shutdown_grace_s)
        backend = make_backend(args, say)
    except (ValueError, BackendError) as exc:
        print(f"astralight autoscale: {exc}", file=sys.stderr)
        return 2
    client = DataflowClient(args.dataflow, retry_s=30.0)
    scaler = Autoscaler(policy, backend, client, config)
    stop = threading.Event()

    def on_signal(signum, _frame):
        if stop.is_set():  # second signal: no more waiting for drains
            say("second signal: stopping instances now")
            if isinstance(backend, LocalProcessBackend):
                backend.drain_timeout_s = 0.0
                for proc in backend.procs.values():
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
            elif hasattr(backend, "stop_now"):  # the Ray backend
                backend.stop_now()
            return
        say(f"{signal.Signals(signum).name}: retiring the instances it started")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    say(f"started: model {args.model_id}, bounds {args.min}..{args.max}, every {args.every} "
        f"versions, cooldown {args.cooldown_s:.0f}s, backend {args.backend}, "
        f"decisions {decisions_log}")
    try:
        return scaler.run(stop)
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
