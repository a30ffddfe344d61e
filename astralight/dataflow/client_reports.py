"""The read-mostly calls of :class:`~astralight.dataflow.client.DataflowClient` that answer JSON:
service info and stats, eval results and completions, the balance report and per-version
counters (and ``request_eval``, which asks for an eval the results then show)."""

from __future__ import annotations


class ReportCalls:
    """Mixed into :class:`~astralight.dataflow.client.DataflowClient`, whose ``_send`` and
    ``_call`` carry every request (retries, auth, errors)."""

    def info(self) -> dict:
        return self._send("GET", "/v1/info").json()

    def stats(self) -> dict:
        return self._send("GET", "/v1/stats").json()

    def eval_results(self, model_id: str) -> dict[int, dict]:
        data = self._send("GET", f"/v1/eval/{model_id}").json()
        return {int(v): r for v, r in data.items()}

    def eval_completions(self, model_id: str, version: int, limit: int | None = None) -> list[dict]:
        """A few sample completions of the eval of ``version``
        (GET /v1/eval/{model_id}/{version}/completions; see
        :class:`astralight.dataflow.evals.CompletionLog`)."""
        query = f"?limit={int(limit)}" if limit is not None else ""
        path = f"/v1/eval/{model_id}/{int(version)}/completions{query}"
        return self._send("GET", path).json()["completions"]

    def request_eval(self, model_id: str, version: int) -> dict:
        """Evaluate ``version`` (the current one) of ``model_id`` whatever ``eval.every`` says,
        once (POST /v1/eval): ``{model_id, version, evals_scheduled}``; a version not current
        (yet) or a service without an eval source is a :class:`DataflowError` 409."""
        return self._call("POST", "/v1/eval", {"model_id": model_id, "version": int(version)})

    def balance(self, model_id: str, window: int = 10, pool: int | None = None,
                last: int | None = None) -> dict:
        """The balance report over the last ``window`` versions, or the ``window`` versions up
        to ``last`` (GET /v1/balance/{model_id})."""
        query = (f"window={int(window)}" + (f"&pool={int(pool)}" if pool is not None else "")
                 + (f"&last={int(last)}" if last is not None else ""))
        return self._send("GET", f"/v1/balance/{model_id}?{query}").json()

    def counters(self, model_id: str, since: int = 0) -> dict[int, dict[str, int]]:
        """Counters of ``model_id`` per policy version (GET /v1/counters/{model_id})."""
        data = self._send("GET", f"/v1/counters/{model_id}?since={int(since)}").json()
        return {int(v): c for v, c in data["versions"].items()}
