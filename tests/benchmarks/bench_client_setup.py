"""What it costs to make a dataflow client: httpx's own trust loading against the shared context.

    python tests/benchmarks/bench_client_setup.py --json [--clients 50]

httpx builds an SSL context and loads the whole trust store into it for every ``httpx.Client``
(``verify=True``), even for an ``http://`` URL. The launcher reads the dataflow through
short-lived clients every second, so on a two-core machine that load was a tenth of a core
taken from the trainer or the RaaS. :func:`astralight.dataflow.client_credentials.tls_verify`
loads each trust source once per process and shares the context.

Arms, in one invocation, each making and closing ``--clients`` clients of ``http://127.0.0.1``:

- ``baseline``: ``httpx.Client(base_url=..., verify=True)``, what every client did before;
- ``shared``: :class:`astralight.dataflow.client.DataflowClient` (the shared context).

Prints JSON: CPU milliseconds per client for each arm (process CPU time, robust to other
processes on shared cores), ``ratio`` (= shared / baseline), and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def cpu_ms_per_client(make, n: int) -> float:
    make().close()  # the first one may import or load; not counted
    start = time.process_time()
    for _ in range(n):
        make().close()
    return (time.process_time() - start) / n * 1000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    import httpx

    from astralight.dataflow.client import DataflowClient

    url = "http://127.0.0.1:9"
    load_before = list(os.getloadavg())
    baseline = cpu_ms_per_client(lambda: httpx.Client(base_url=url, verify=True), args.clients)
    shared = cpu_ms_per_client(lambda: DataflowClient(url, token="", retry_s=0), args.clients)
    out = {"bench": "client_setup", "clients": args.clients,
           "baseline_cpu_ms_per_client": round(baseline, 3),
           "shared_cpu_ms_per_client": round(shared, 3),
           "ratio": round(shared / baseline, 4) if baseline else None,
           "load_before": load_before, "load_after": list(os.getloadavg())}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
