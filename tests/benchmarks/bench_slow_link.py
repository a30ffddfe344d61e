"""Benchmark: a RaaS on a slow link (loopback proxy shaped by ``astralight.netshape``).

    python tests/benchmarks/bench_slow_link.py --json                      # 20 Mbit/s, 50 ms RTT
    python tests/benchmarks/bench_slow_link.py --json --mbit 50 --rtt-ms 40 --params 2e7

Prints one JSON object:

* ``link_mbit``, ``link_rtt_ms``: the shaped link between the RaaS and the dataflow.
* ``refresh``: weight refresh latency through the link of a synthetic bf16 model of ``--params``
  elements (fp32 masters ~N(0, 0.02) stepped like Adam so ``--sparsity`` of the bf16 patterns stay
  the same): a newcomer's full pull versus the next version's delta. Seconds from "a newer version
  is published" to "verified bf16 state ready to load", through the real dataflow service and
  :class:`astralight.raas.weight_sync.WeightSync` (the engine here only records; vLLM's load is
  the ``pause`` the toy runs report). Also on a direct (unshaped) connection for reference.
* ``toy``: the shortened toy recipe (``astralight run``: dataflow, vLLM RaaS, Lightning trainer)
  twice, with the RaaS behind the link and directly connected: trainer step compute time
  (median of TensorBoard ``perf/step_compute_s``), trainer wait per step, publish latency, RaaS
  samples/s, the RaaS's weight refreshes (route, bytes, seconds) and whether the weights vLLM
  holds at the end are bit-identical to the trainer's published bf16 weights.

The helpers (:func:`run_toy`, :func:`tensorboard_scalars`) are shared with
tests/integration/test_slow_link.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from astralight.netshape import ShapedProxy


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toy_recipe(path: Path, versions: int, batch_size: int, port: int, raas_dataflow: str | None,
               report: Path | None, sft_steps: int = 20) -> Path:
    """The embedded toy recipe, shortened, on a fixed dataflow port; the RaaS may be pointed at
    another URL (a proxy) and asked for a held-weights report at shutdown."""
    from astralight.launch import _default_recipe

    recipe = yaml.safe_load(_default_recipe().read_text())
    recipe["port"] = port
    recipe["prepare"]["kwargs"]["sft_steps"] = sft_steps
    recipe["stop"].update(versions=versions, timeout_s=480, progress_every_s=5)
    recipe["dataflow"]["eval"].update(every=versions, k=2)
    recipe["dataflow"]["eval"]["source"]["init_args"]["eval_size"] = 16
    raas = recipe["raas"][0]
    if raas_dataflow:
        raas["dataflow"] = raas_dataflow  # the config file overrides the launcher's --dataflow
    if report:
        raas["held_weights_report"] = str(report)
    trainer = recipe["trainers"][0]
    trainer["trainer"]["max_steps"] = versions
    trainer["data"]["init_args"]["batch_size"] = batch_size
    for cb in trainer["trainer"].get("callbacks") or []:  # last.ckpt = the final weights
        if cb.get("class_path", "").endswith("ModelCheckpoint"):
            cb.setdefault("init_args", {})["every_n_train_steps"] = versions
    path.write_text(yaml.safe_dump(recipe))
    return path


def tensorboard_scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[float]] = {}
    for events in glob.glob(str(run_dir / "tensorboard" / "policy" / "*" / "events*")):
        acc = EventAccumulator(events)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return out


def checkpoint_bf16_checksums(run_dir: Path, names) -> dict[str, str]:
    """sha256 of the trainer's final weights (last.ckpt) cast to bf16, under checkpoint names."""
    import torch

    from astralight.weights.bf16 import tensor_checksum

    ckpt = torch.load(run_dir / "checkpoints" / "policy" / "last.ckpt", map_location="cpu",
                      weights_only=False)
    sd = ckpt["state_dict"]
    out = {}
    for name in names:
        key = f"model.{name}"  # M2POPolicy keeps the transformers model as ``self.model``
        if key in sd:
            out[name] = tensor_checksum(sd[key].to(torch.bfloat16))
    return out


def _raas_samples_per_s(log_text: str) -> float | None:
    """Samples pushed per second of the RaaS's serving time (after engine start-up)."""
    ready = [ln for ln in log_text.splitlines() if "raas ready" in ln]
    progress = [ln for ln in log_text.splitlines() if ln.startswith("[raas")]
    if not ready or not progress:
        return None
    fields = dict(kv.split("=", 1) for kv in ready[-1].split() if "=" in kv)
    startup = float(fields.get("engines_up_s", 0)) + float(fields.get("warmup_s", 0))
    last = progress[-1]
    elapsed = float(last.split("]")[0].split()[1].rstrip("s"))
    samples = int(last.split("| samples ")[1].split()[0])
    return samples / max(elapsed - startup, 1e-9)


def start_proxy_process(port: int, link: tuple[float, float], lifetime_s: float,
                        cpus: list[int] | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m astralight.netshape`` in front of ``127.0.0.1:port``; returns (process, url).

    ``cpus`` pins the proxy (on the toy recipe's two cores: the RaaS's core, so the link costs
    the trainer's core nothing, as a real network link would)."""
    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    proc = subprocess.Popen([sys.executable, "-m", "astralight.netshape", "--listen", "127.0.0.1:0",
                             "--target", f"127.0.0.1:{port}", "--mbit", str(link[0]),
                             "--rtt-ms", str(link[1]), "--duration-s", str(lifetime_s)],
                            stdout=subprocess.PIPE, text=True, preexec_fn=pin)
    line = proc.stdout.readline()
    if not line.startswith("netshape listening on "):
        proc.kill()
        raise RuntimeError(f"netshape did not start: {line!r}")
    return proc, f"http://{line.split()[3]}"


def stop_proxy_process(proc: subprocess.Popen) -> dict | None:
    """SIGTERM the proxy; return its final byte counters."""
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    for line in reversed(out.splitlines()):
        if line.startswith('{"netshape"'):
            return json.loads(line)["netshape"]
    return None


def run_toy(work_dir: Path, versions: int = 4, batch_size: int = 16,
            link: tuple[float, float] | None = None, timeout_s: float = 600,
            proxy_cpus: list[int] | None = None) -> dict:
    """One shortened toy run; ``link=(mbit, rtt_ms)`` puts the RaaS behind a shaped proxy process
    (pinned to ``proxy_cpus``; default: the recipe's RaaS cores)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    if proxy_cpus is None:
        from astralight.launch import _default_recipe

        affinity = yaml.safe_load(_default_recipe().read_text()).get("cpu_affinity") or {}
        proxy_cpus = [c for c in affinity.get("raas", []) if c in os.sched_getaffinity(0)] or None
    report = work_dir / "raas-held-weights.json"
    proxy = proxy_url = None
    if link is not None:
        proxy, proxy_url = start_proxy_process(port, link, timeout_s + 60, cpus=proxy_cpus)
    try:
        recipe = toy_recipe(work_dir / "recipe.yaml", versions, batch_size, port, proxy_url, report)
        run_dir = work_dir / "run"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", str(recipe),
                               "--run-dir", str(run_dir)],
                              capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - start
    finally:
        proxy_stats = stop_proxy_process(proxy) if proxy is not None else None
    if proc.returncode != 0:
        raise RuntimeError(f"toy run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())  # the full record
    scalars = tensorboard_scalars(run_dir)
    raas_log = (run_dir / "logs" / "raas-0.log").read_text(errors="replace")
    held = json.loads(report.read_text())["policy"] if report.exists() else {}
    ckpt = checkpoint_bf16_checksums(run_dir, held.get("held", {})) if held.get("held") else {}
    return {
        "summary": summary, "run_dir": str(run_dir), "wall_s": wall, "scalars": scalars,
        "raas_log": raas_log, "held": held, "checkpoint_bf16": ckpt,
        "proxy": proxy_stats,
        "raas_samples_per_s": _raas_samples_per_s(raas_log),
    }


def _median(xs):
    return statistics.median(xs) if xs else None


def toy_figures(run: dict) -> dict:
    s, held = run["scalars"], run["held"]
    events = held.get("sync", {}).get("events", [])
    by_route: dict[str, list[float]] = {}
    for e in events:
        by_route.setdefault(e["route"], []).append(e["seconds"])
    return {
        "trainer_step_compute_s_median": _median(s.get("perf/step_compute_s", [])[1:]),
        "trainer_wait_s_median": _median(s.get("perf/wait_s", [])[1:]),
        "publish_latency_s_median": _median(s.get("publish/latency_s", [])),
        "raas_samples_per_s": run["raas_samples_per_s"],
        "raas_refresh_s_median": {k: _median(v) for k, v in by_route.items()},
        "raas_refreshes": {k: len(v) for k, v in by_route.items()},
        "raas_pause_s_total": held.get("sync", {}).get("pause_s_total"),
        "held_version": held.get("version"),
        "held_bit_identical_to_trainer": bool(run["checkpoint_bf16"]) and
        run["checkpoint_bf16"] == held.get("held"),
        "wall_s": round(run["wall_s"], 1),
        "link_bytes_down": (run["proxy"] or {}).get("bytes_down"),
    }


# ----------------------------------------------------------------------------- refresh latency


def _synthetic(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = max(1, n // 4096)
    return {f"layers.{i}.weight": torch.randn(min(rows, 1024), 4096, generator=g) * 0.02
            for i in range((rows + 1023) // 1024)}


def _calibrate_lr(sample, sparsity: float) -> float:
    """Step size whose ``w + lr * N(0, 1)`` keeps ``sparsity`` of the bf16 patterns (bisection)."""
    import torch

    w = sample.reshape(-1)[:1_000_000]
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(7))
    lo, hi = 1e-9, 1e-1
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        same = float((w.to(torch.bfloat16) == (w + mid * noise).to(torch.bfloat16)).float().mean())
        lo, hi = (mid, hi) if same > sparsity else (lo, mid)
    return (lo * hi) ** 0.5


def refresh_latency(mbit: float | None, rtt_ms: float, params: float, sparsity: float,
                    work_dir: Path) -> dict:
    """Newcomer full pull and next-version delta through the link (or direct when mbit None)."""
    import torch

    from astralight.dataflow.client import DataflowClient
    from astralight.raas.weight_sync import WeightSync
    from astralight.weights import ArtifactBuilder

    state = _synthetic(int(params), 0)
    port = _free_port()
    cfg = work_dir / f"dataflow-{port}.yaml"
    cfg.write_text(yaml.safe_dump({"host": "127.0.0.1", "port": port,
                                   "state_dir": str(work_dir / f"state-{port}")}))
    log = open(work_dir / f"dataflow-{port}.log", "wb")
    svc = subprocess.Popen([sys.executable, "-m", "astralight.dataflow.service", "--config", str(cfg)],
                           stdout=log, stderr=subprocess.STDOUT)
    proxy = None
    try:
        url = f"http://127.0.0.1:{port}"
        pub = DataflowClient(url, retry_s=30)
        pub.info()
        builder = ArtifactBuilder("policy", full_every=100)

        def publish(version, st):
            art = builder.build(version, st)
            for name, data in art.files.items():
                pub.upload_weight_file("policy", version, name, data)
            pub.publish(art.manifest)
            return art.manifest

        class Engine:  # records, like a RaaS engine whose load costs nothing
            version = 0

            def update_weights(self, named, version, partial=False):
                self.version = version

        if mbit is not None:
            proxy = ShapedProxy(("127.0.0.1", port), mbit=mbit, rtt_ms=rtt_ms,
                                max_lifetime_s=3600).start_in_thread()
        sync_url = proxy.url if proxy else url
        sync = WeightSync(lambda: DataflowClient(sync_url, retry_s=30), "policy", Engine(),
                          background=False, check_interval_s=0.0, download_dir=work_dir / "dl")
        m1 = publish(1, state)
        t = time.perf_counter()
        sync.refresh()
        full_s = time.perf_counter() - t
        # an Adam-like step whose bf16 cast keeps ~sparsity of the patterns
        lr = _calibrate_lr(next(iter(state.values())), sparsity)
        g = torch.Generator().manual_seed(1)
        state = {k: v + lr * torch.randn(v.shape, generator=g) for k, v in state.items()}
        m2 = publish(2, state)
        t = time.perf_counter()
        sync.refresh()
        delta_s = time.perf_counter() - t
        sync.close()
        return {"full_s": round(full_s, 3), "delta_s": round(delta_s, 3),
                "full_bytes": sum(f["bytes"] for f in m1.files.values()),
                "delta_bytes": sum(f["bytes"] for f in m2.files.values()),
                "delta_sparsity": m2.metadata.get("sparsity"), "elements": sum(v.numel() for v in state.values())}
    finally:
        if proxy is not None:
            proxy.close()
        svc.terminate()
        svc.wait(30)
        log.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mbit", type=float, default=20.0)
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--params", type=float, default=8e6, help="elements of the synthetic model")
    p.add_argument("--sparsity", type=float, default=0.99)
    p.add_argument("--versions", type=int, default=8, help="toy run length")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--skip-toy", action="store_true", help="only the refresh latency part")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out: dict = {"link_mbit": args.mbit, "link_rtt_ms": args.rtt_ms}
    with tempfile.TemporaryDirectory(prefix="bench-slow-link-") as tmp:
        tmp = Path(tmp)
        out["refresh"] = {
            "params": int(args.params), "sparsity_target": args.sparsity,
            "link": refresh_latency(args.mbit, args.rtt_ms, args.params, args.sparsity, tmp),
            "direct": refresh_latency(None, 0.0, args.params, args.sparsity, tmp),
        }
        if not args.json:
            print(json.dumps(out["refresh"], indent=1), flush=True)
        if not args.skip_toy:
            out["toy"] = {"versions": args.versions, "batch_size": args.batch_size}
            for name, link in (("with_link", (args.mbit, args.rtt_ms)), ("without_link", None)):
                run = run_toy(tmp / name, args.versions, args.batch_size, link)
                out["toy"][name] = toy_figures(run)
                if not args.json:
                    print(name, json.dumps(out["toy"][name]), flush=True)
            w, wo = out["toy"]["with_link"], out["toy"]["without_link"]
            if w["trainer_step_compute_s_median"] and wo["trainer_step_compute_s_median"]:
                out["toy"]["step_compute_ratio_with_over_without"] = round(
                    w["trainer_step_compute_s_median"] / wo["trainer_step_compute_s_median"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
