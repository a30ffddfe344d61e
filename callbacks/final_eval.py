"""Asking the dataflow to evaluate a fit's last version, shared by the callbacks that wait for
it (:class:`~astralight.callbacks.DataflowMonitor`, which logs it, and
:class:`~astralight.callbacks.BestEvalCheckpoint`, which may keep it). A fit that ends between two
multiples of ``eval.every`` (``max_steps`` not a multiple, ``max_time``, a stop by SIGTERM)
otherwise waits for an evaluation never scheduled."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def request_final_eval(client: Any, model_id: str, version: int, who: str) -> bool | None:
    """Ask the dataflow to evaluate ``version`` whatever ``eval.every`` says (``POST
    /v1/eval``; nothing happens when it is already scheduled). True once accepted; False to ask
    again (the version is not published yet, the service does not answer); None when the
    service has no eval source."""
    from astralight.dataflow.client import DataflowError

    try:
        client.request_eval(model_id, version)
        return True
    except DataflowError as exc:
        if exc.status == 409 and exc.field == "eval":
            return None
        log.debug("%s: eval of version %d not scheduled yet (%s)", who, version, exc)
        return False
    except Exception as exc:  # a callback watching the run must never stop training
        log.debug("%s: eval of version %d not requested (%s)", who, version, exc)
        return False
