"""What a :class:`~astralight.dataflow.client.DataflowClient` does when the dataflow cannot store
anything: it answers 507 naming ``state_dir`` (its state folder is full or cannot be written;
:mod:`astralight.dataflow.storage_faults`).

Nothing of a refused request was stored, so sending it again is safe, and the fault is the
operator's to fix (free space), typically within minutes. The client therefore retries such a
call like a call to an unreachable service: with backoff, for up to its ``retry_s``, stopping at
once when the process is asked to stop; after that it raises the 507 as a
:class:`~astralight.dataflow.client_errors.DataflowError` whose message names ``state_dir`` and
the fix. It is never silent and never floods: the first refusal of an episode logs one warning
per dataflow URL and process (the service's own message: which folder, why, what to do), the
refusals after it only count, and the first answer that is not such a refusal logs one line
saying how long it lasted. A weight store that is full (507 naming ``disk``) is not retried:
the publisher skips that version and goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx

log = logging.getLogger("astralight.dataflow.client")  # one logger for the whole client


def storage_refusal(resp: httpx.Response) -> str | None:
    """The service's message if ``resp`` is a 507 naming ``state_dir`` (a batched push names
    ``items[i].state_dir``), else None."""
    if resp.status_code != 507:
        return None
    try:
        err = resp.json()
    except ValueError:
        return None
    if not isinstance(err, dict) or not str(err.get("field") or "").endswith("state_dir"):
        return None
    return str(err.get("error") or "state_dir cannot store anything")


class StorageOutages:
    """One episode per dataflow URL: logged when it starts and when it ends (module docstring).
    Shared by every client of the process (threads included)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, list] = {}  # url -> [started (monotonic), refusals]

    def refused(self, url: str, message: str, retry_s: float) -> None:
        with self._lock:
            episode = self._open.get(url)
            if episode is None:
                self._open[url] = [time.monotonic(), 1]
            else:
                episode[1] += 1
        if episode is None:
            log.warning("the dataflow at %s cannot store anything (507): %s -- retrying for up to "
                        "%.0f s per call; further refusals are not logged until it stores again",
                        url, message, retry_s)

    def answered(self, url: str) -> None:
        """An answer that is not a storage refusal: ends the episode under way, if any."""
        if url not in self._open:  # (the common case: no lock)
            return
        with self._lock:
            episode = self._open.pop(url, None)
        if episode is not None:
            log.warning("the dataflow at %s answers again after %d call(s) refused with 507 over "
                        "%.0f s", url, episode[1], time.monotonic() - episode[0])


#: the process's episodes
STORAGE_OUTAGES = StorageOutages()


def retry_refusal(client: Any, resp: httpx.Response, deadline: float, delay: float,
                  poll_s: float) -> bool:
    """True when ``resp`` is a storage refusal that ``client`` should send again: logged (once
    per episode) and slept ``delay`` seconds (in slices of ``poll_s``, watching the stop flags).
    False for any other answer, and for a refusal when ``retry_s`` would pass or a stop is
    requested (the caller raises it as the 507 it is)."""
    message = storage_refusal(resp)
    if message is None:
        STORAGE_OUTAGES.answered(client.url)
        return False
    end = time.monotonic() + delay
    if end > deadline or client._stop_reason() is not None:
        return False  # raised to the caller, with the service's message
    STORAGE_OUTAGES.refused(client.url, message, client.retry_s)
    while True:
        if client._stop_reason() is not None:
            return False
        left = end - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, poll_s))
