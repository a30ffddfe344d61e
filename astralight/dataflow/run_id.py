"""The run id of a dataflow state: which run a RaaS's weights, tasks and samples belong to.

A state folder gets a random run id when it is created, kept in its ``meta`` table (key
``run_id``), so a restart on the same ``state_dir`` keeps it and a restart on a fresh one gets a
new one. The dataflow names it in the answers of register, heartbeat, ``/v1/info`` and
``/v1/version/{model_id}``, and in the :data:`RUN_ID_HEADER` header of the manifest routes (what
a RaaS's weight sync polls). A push may carry the ``run_id`` its samples were generated for; a
dataflow of another run refuses it (409 naming ``run_id``).

Why: version numbers restart at 0 in a new run. Without the run id a RaaS that held v5 of the
old run would wait for a v6 that never comes, and once the new run reached v5 its samples (made
with the old run's weights) would be accepted as on-policy.
"""

from __future__ import annotations

import secrets
from typing import Any

#: meta key of the state's run id
META_KEY = "run_id"
#: response header naming the dataflow's run id (the manifest and version routes)
RUN_ID_HEADER = "X-Astralight-Run-Id"


def new_run_id() -> str:
    """A fresh random run id (16 hex digits: two runs never share one)."""
    return secrets.token_hex(8)


def open_run_id(store: Any) -> str:
    """The run id of ``store``'s state, created and written (inside the caller's transaction)
    the first time: a state folder from before run ids gets one at its first start."""
    run_id = store.get_meta(META_KEY)
    if not isinstance(run_id, str) or not run_id:
        run_id = new_run_id()
        store.set_meta(META_KEY, run_id)
    return run_id
