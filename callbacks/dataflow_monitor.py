"""DataflowMonitor: the dataflow side of a run, in the trainer's TensorBoard.

The dataflow service owns the held-out evaluation and the data counters (accepted, stale-dropped,
queue depth); the trainer only sees the batches it is served. This callback polls the service
every ``every_n_steps`` optimizer steps and logs what it reports, so one TensorBoard shows the
whole run: ``eval/avg_at_k`` and ``eval/pass_at_k`` at the step where each evaluated version was
published (with ``eval/pass_at_<k>`` for every k of ``eval.pass_k``, and with a multi-benchmark
eval source ``eval/benchmark_average`` (avg@k), ``eval/benchmark_average_pass_at_k``,
``eval/benchmark_average_pass_at_<k>`` and ``eval/<benchmark>/avg_at_k`` / ``pass_at_<k>``), and
``dataflow/*`` counters at the current step. The headline pass@k is ``eval/pass_at_k`` (k =
``eval.k``) and is not repeated as ``eval/pass_at_<k>``: the other k of ``eval.pass_k`` get their
own tags (the same for the benchmark average and each benchmark).

Beside each evaluated version's scalars it logs **a table of sample completions** (the
dataflow keeps the first completion of each of the first few prompts reported:
``GET /v1/eval/{model_id}/{version}/completions``): columns prompt, completion, reward,
finish reason, with the completion decoded by the policy's tokenizer when the workflow sent token
ids only. TensorBoard gets it as text (``eval/completions``, a markdown table, on the TEXT tab),
a logger with ``log_table`` (Lightning's ``WandbLogger``) as a table; other loggers get none.

The data algorithms (prompt curators, sample filters, replay) run in the dataflow, so their cost
and effect are visible only there: ``dataflow/rollouts_generated`` (the rollout cost),
``dataflow/prompts_skipped``, ``dataflow/groups_filtered``, ``dataflow/replay_served``, ... and each
plugin's own gauges as ``dataflow/plugins/<slot>_<Class>/<metric>`` (e.g.
``dataflow/plugins/curators_0_GRESO/p_easy``).
"""

from __future__ import annotations

import logging
import math
import re
import time

import lightning.pytorch as pl

from astralight.dataflow.client import LazyDataflowClient

from . import eval_table
from .final_eval import request_final_eval

log = logging.getLogger(__name__)

#: dataflow counters worth a curve; the stats route has more
STAT_KEYS = ("samples_accepted", "stale_dropped", "samples_acked", "duplicates_ignored",
             "tasks_reissued", "queue_depth", "current_version")
#: counters of the data algorithms (curators, sample filters, replay); logged when reported
DATA_ALGORITHM_KEYS = ("rollouts_generated", "prompts_submitted", "prompts_skipped",
                       "prompts_forced", "groups_filtered", "samples_filtered", "samples_served",
                       "replay_added", "replay_served", "replay_evicted", "replay_stale_dropped",
                       "replay_exhausted", "replay_pool", "samples_trained")

_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def _tag(text: str) -> str:
    """A TensorBoard-friendly tag part: ``curators[0]`` -> ``curators_0``."""
    return _TAG_UNSAFE.sub("_", str(text)).strip("_") or "_"


def _number(value) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def eval_metrics(result: dict) -> dict[str, float]:
    """The extra scalars of one eval result beyond avg@k / pass@k: pass@k for every reported k,
    the benchmark averages and each benchmark's numbers (whatever the service reports; an older
    service reports none of them)."""
    out: dict[str, float] = {}

    def put(tag: str, value) -> None:
        number = _number(value)
        if number is not None:
            out[tag] = number

    headline = str(result.get("k")) if result.get("k") is not None else None

    def others(table) -> list:
        """pass@j for every j but the headline k (that one is already ``..._pass_at_k``)."""
        return [(j, v) for j, v in (table or {}).items() if str(j) != headline]

    for k, value in others(result.get("pass_at")):
        put(f"eval/pass_at_{_tag(k)}", value)
    put("eval/benchmark_average", result.get("benchmark_average"))
    put("eval/tool_call_rate", result.get("tool_call_rate"))  # tool workflows only
    put("eval/benchmark_average_pass_at_k", result.get("benchmark_average_pass_at_k"))
    for k, value in others(result.get("benchmark_average_pass_at")):
        put(f"eval/benchmark_average_pass_at_{_tag(k)}", value)
    for name, row in (result.get("benchmarks") or {}).items():
        if not isinstance(row, dict) or not row.get("n_reported", 1):
            continue
        put(f"eval/{_tag(name)}/avg_at_k", row.get("avg_at_k"))
        put(f"eval/{_tag(name)}/pass_at_k", row.get("pass_at_k"))
        for k, value in others(row.get("pass_at")):
            put(f"eval/{_tag(name)}/pass_at_{_tag(k)}", value)
    return out


def stat_metrics(model_stats: dict) -> dict[str, float]:
    """``dataflow/<counter>`` for every known counter the stats route reports as a number."""
    out = {}
    for key in STAT_KEYS + DATA_ALGORITHM_KEYS:
        value = _number(model_stats.get(key))
        if value is not None:
            out[f"dataflow/{key}"] = value
    return out


def plugin_metrics(plugins: dict | None) -> dict[str, float]:
    """``dataflow/plugins/<slot>_<Class>/<metric>`` for each numeric plugin gauge.

    ``plugins`` is the stats route's ``{"curators[0]": {"class": "GRESO", "metrics": {...}}}``.
    """
    out = {}
    for slot, info in (plugins or {}).items():
        if not isinstance(info, dict):
            continue
        name = _tag(slot) + (f"_{_tag(info['class'])}" if info.get("class") else "")
        for metric, value in (info.get("metrics") or {}).items():
            value = _number(value)
            if value is not None:
                out[f"dataflow/plugins/{name}/{_tag(metric)}"] = value
    return out


def balance_metrics(report: dict) -> dict[str, float]:
    """``balance/*`` scalars of a balance report (``/v1/balance/{model_id}``), the RaaS's weight
    pauses (``raas/weight_pause_s``: seconds generation stood still for weight loads, summed over
    the pool, cumulative) and, for tool workflows, ``balance/agent/*``."""
    out = {}
    pause = _number(report.get("weight_pause_s"))
    if pause is not None:
        out["raas/weight_pause_s"] = pause
    agent = report.get("agent") or {}
    for key in ("tool_call_rate", "tool_calls_per_episode"):
        value = _number(agent.get(key))
        if value is not None:
            out[f"balance/agent/{key}"] = value
    for kind, n in (agent.get("tool_errors") or {}).items():
        value = _number(n)
        if value is not None:
            out[f"balance/agent/tool_errors/{_tag(kind)}"] = value
    for key in ("wait_fraction", "mean_step_s", "mean_wait_s", "produced", "accepted", "consumed",
                "stale", "wall_s", "eval_s", "throughput_per_capacity_unit"):
        value = _number(report.get(key))
        if value is not None:
            out[f"balance/{key}"] = value
    decision = report.get("decision") or {}
    for key in ("pool", "target"):
        value = _number(decision.get(key))
        if value is not None:
            out[f"balance/{key}"] = value
    action = {"scale_down": -1.0, "hold": 0.0, "scale_up": 1.0}.get(decision.get("action"))
    if action is not None:
        out["balance/action"] = action
    return out


def _log_everywhere(trainer: pl.Trainer, metrics: dict, step: int) -> None:
    """Log to every logger of the trainer (TensorBoard and W&B both get ``eval/*``), not only
    the first (``trainer.logger``)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class DataflowMonitor(LazyDataflowClient, pl.Callback):
    """Log the dataflow's eval results and counters for this trainer's policy.

    Args:
        dataflow_url: the dataflow service (default: the datamodule's ``dataflow_url``).
        model_id: the policy (default: the module's ``model_id``).
        every_n_steps: poll the service every this many optimizer steps.
        steps_per_version: optimizer steps per published version, to place an eval of version v
            at step ``v * steps_per_version`` (default: the WeightPublisher's ``every_n_steps``).
        wait_final_eval_s: at the end of fit, wait up to this long for the evaluation of the
            last published version so it reaches TensorBoard too (0: don't wait); that
            evaluation is requested from the dataflow when ``eval.every`` would skip it.
        token: bearer token (default: env ``ASTRALIGHT_TOKEN``).
        balance_every: log the dataflow's balance report (trainer wait fraction, produced /
            accepted / consumed counts, the pool decision) over the last this many versions,
            every this many versions, as ``balance/*`` (0: off).
        completions: rows of the sample-completions table logged with each evaluated version
            (``eval/completions``: TensorBoard text, W&B table; at most what the dataflow keeps,
            8); 0: off.
    """

    def __init__(self, dataflow_url: str | None = None, model_id: str | None = None,
                 every_n_steps: int = 5, steps_per_version: int | None = None,
                 wait_final_eval_s: float = 0.0, token: str | None = None,
                 balance_every: int = 10, completions: int = 8):
        super().__init__()
        if completions < 0:
            raise ValueError(f"completions: must be >= 0 rows (0: off), got {completions}")
        self.completions = completions
        self._model_path: str | None = None
        self._tokenizer = None  # loaded at the first completion sent as token ids
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps: must be >= 1, got {every_n_steps}")
        if wait_final_eval_s < 0:
            raise ValueError(f"wait_final_eval_s: must be >= 0, got {wait_final_eval_s}")
        self.dataflow_url, self.model_id, self.token = dataflow_url, model_id, token
        self.every_n_steps, self.steps_per_version = every_n_steps, steps_per_version
        self.wait_final_eval_s = wait_final_eval_s
        if balance_every < 0:
            raise ValueError(f"balance_every: must be >= 0 versions (0: off), got {balance_every}")
        self.balance_every = balance_every
        self._balance_logged_at = 0
        self.logged_versions: set[int] = set()
        self._client = None

    # ------------------------------------------------------------------ setup

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        dm = getattr(trainer, "datamodule", None)
        self.dataflow_url = self.dataflow_url or getattr(dm, "dataflow_url", None)
        self.model_id = self.model_id or getattr(pl_module, "model_id", None) or "policy"
        self._model_path = getattr(pl_module, "model_path", None)
        if self.steps_per_version is None:
            from .weight_publisher import WeightPublisher

            pubs = [c for c in trainer.callbacks if isinstance(c, WeightPublisher)]
            self.steps_per_version = pubs[0].every_n_steps if pubs else 1
        if not self.dataflow_url:
            raise ValueError("dataflow_url: not set and the datamodule has none; set "
                             "callbacks[DataflowMonitor].init_args.dataflow_url")

    def make_client(self):
        from astralight.dataflow.client import DataflowClient

        # a short retry: monitoring waits for nothing, the next poll tries again
        return DataflowClient(self.dataflow_url, token=self.token, retry_s=5.0)

    # ------------------------------------------------------------------ polling

    def poll(self, trainer: pl.Trainer) -> dict:
        """Log new complete eval results and the current counters; returns the eval table."""
        if not trainer.loggers or trainer.global_rank != 0:
            return {}
        client = self.client
        try:
            evals = client.eval_results(self.model_id)
            all_stats = client.stats()
        except Exception as exc:  # monitoring must never stop training
            log.warning("DataflowMonitor: dataflow not reachable (%s)", exc)
            return {}
        for version in sorted(evals):
            result = evals[version]
            if result.get("complete") and version not in self.logged_versions:
                self.logged_versions.add(version)
                _log_everywhere(trainer,
                                {"eval/avg_at_k": float(result["avg_at_k"]),
                                 "eval/pass_at_k": float(result["pass_at_k"]),
                                 "eval/version": float(version), **eval_metrics(result)},
                                step=version * self.steps_per_version)
                self.log_completions(trainer, version, step=version * self.steps_per_version)
        stats = (all_stats.get("models") or {}).get(self.model_id, {})
        metrics = {**stat_metrics(stats), **plugin_metrics(all_stats.get("plugins"))}
        version = int(stats.get("current_version") or 0)
        if self.balance_every and version - self._balance_logged_at >= self.balance_every:
            try:
                metrics.update(balance_metrics(client.balance(self.model_id, self.balance_every)))
                self._balance_logged_at = version
            except Exception as exc:  # an older service without the route: monitoring goes on
                log.warning("DataflowMonitor: no balance report (%s)", exc)
                self.balance_every = 0
        if metrics:
            _log_everywhere(trainer, metrics, step=trainer.global_step)
        return evals

    def log_completions(self, trainer: pl.Trainer, version: int, step: int) -> None:
        """The table of sample completions of ``version`` (``eval/completions``; see
        :mod:`astralight.callbacks.eval_table`). A service without the route turns it off."""
        if not self.completions:
            return
        try:
            rows = self.client.eval_completions(self.model_id, version, limit=self.completions)
        except Exception as exc:  # an older service: no table, monitoring goes on
            log.warning("DataflowMonitor: no completions table (%s)", exc)
            self.completions = 0
            return
        if rows:
            data = eval_table.table_rows(rows, self._decode)
            eval_table.log_table(trainer.loggers, "eval/completions", eval_table.COLUMNS, data,
                                 step)

    def _decode(self, ids: list[int]) -> str | None:
        """Token ids -> text with the policy's tokenizer (``model_path``), loaded once (tried
        once: a folder without a tokenizer leaves the ids as they are)."""
        if self._tokenizer is None:
            path, self._model_path = self._model_path, None
            if not path:
                return None
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(path)
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.poll(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        last = trainer.global_step // max(1, self.steps_per_version)
        deadline = time.monotonic() + self.wait_final_eval_s
        requested = False
        while True:
            evals = self.poll(trainer)
            done = evals.get(last, {}).get("complete", False)
            if done or last in self.logged_versions or time.monotonic() >= deadline:
                break
            if not requested and last not in evals:
                requested = self._request_final_eval(last)
                if requested is None:  # the service evaluates nothing: no eval to wait for
                    break
            time.sleep(1.0)
        for logger in trainer.loggers:
            logger.finalize("success")
        self.close_client()

    def _request_final_eval(self, version: int) -> bool | None:
        """:func:`~.final_eval.request_final_eval` of ``version``, the trainer's last."""
        return request_final_eval(self.client, self.model_id, version, "DataflowMonitor")

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict:
        return {"logged_versions": sorted(self.logged_versions)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.logged_versions = set(state_dict.get("logged_versions", []))
