"""Benchmark of the trainer's token log-probs: memory kept for the backward, and time.

    python tests/benchmarks/bench_token_logprobs.py --json                 # 1024 tokens x 151,936
    python tests/benchmarks/bench_token_logprobs.py --json --tokens 4096

Why: the log-prob of each sampled token under the policy is taken from ``[N, V]`` bf16 logits
(V = 151,936 for Qwen3). Computed chunk by chunk through autograd (the baseline here, what
``astralight.rl.logprobs`` did before), every chunk's float32 upcast stays saved for the backward:
``4 N V`` bytes. ``token_logprobs`` as shipped saves the logits as they came plus the per-token
log-normaliser (``2 N V + 12 N`` bytes) and recomputes the softmax chunk by chunk in its backward.
Both ways run in the same process on the same bf16 logits: bytes saved for the backward (counted
by ``torch.autograd.graph.saved_tensors_hooks``), forward + backward seconds (best of
``--repeats``), and the largest gradient difference between them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def baseline(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
             chunk: int) -> torch.Tensor:
    """Chunked ``gather - logsumexp`` through autograd: the float32 chunks are saved."""
    pieces = []
    for start in range(0, targets.shape[0], chunk):
        part = logits[start:start + chunk].float() / temperature
        picked = part.gather(-1, targets[start:start + chunk, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(part, dim=-1))
    return torch.cat(pieces)


def measure(fn, logits, targets, weights, repeats: int) -> tuple[int, float, torch.Tensor]:
    saved: dict[int, int] = {}  # storage address -> bytes: a slice counts its base once

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    best, grad = float("inf"), None
    for i in range(repeats):
        x = logits.detach().requires_grad_(True)
        t0 = time.perf_counter()
        if i == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn(x, targets)
        else:
            out = fn(x, targets)
        (grad,) = torch.autograd.grad((out * weights).sum(), x)
        best = min(best, time.perf_counter() - t0)
    return sum(saved.values()), best, grad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.vocab < 2 or args.repeats < 1 or args.temperature <= 0:
        p.error("--tokens >= 1, --vocab >= 2, --repeats >= 1, --temperature > 0")
    sys.path.insert(0, str(ROOT))
    from astralight.rl.logprobs import DEFAULT_CHUNK_ELEMENTS, token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    weights = torch.randn(args.tokens, generator=g)
    chunk = max(1, DEFAULT_CHUNK_ELEMENTS // args.vocab)
    t = args.temperature
    print(f"{args.tokens} tokens x {args.vocab} vocab, bf16 logits "
          f"{logits.numel() * 2 / 2**20:.0f} MiB, chunk {chunk} tokens", file=sys.stderr)
    base_bytes, base_s, base_grad = measure(lambda x, y: baseline(x, y, t, chunk), logits,
                                            targets, weights, args.repeats)
    new_bytes, new_s, new_grad = measure(lambda x, y: token_logprobs(x, y, t, chunk), logits,
                                         targets, weights, args.repeats)
    result = {
        "tokens": args.tokens, "vocab": args.vocab,
        "saved_mib": {"autograd_chunks": round(base_bytes / 2**20, 1),
                      "token_logprobs": round(new_bytes / 2**20, 1)},
        "saved_ratio": round(base_bytes / max(new_bytes, 1), 2),
        "fwd_bwd_s": {"autograd_chunks": round(base_s, 3), "token_logprobs": round(new_s, 3)},
        "speed_ratio": round(base_s / new_s, 2),
        "max_grad_diff": float((base_grad.float() - new_grad.float()).abs().max()),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
