"""Feasibility of the toy recipe: does RL visibly raise held-out accuracy within the step budget?

Simulates the RL phase of ``astralight run`` on the toy recipe IN ONE PROCESS, without the
dataflow service, RaaS or Lightning, so that recipe settings can be swept in seconds:

1. the supervised warm start (``astralight.tasks.warmstart.train_warmstart``);
2. per RL step: ``prompts_per_step`` train-split prompts, ``n`` samples each, drawn with plain
   torch at ``temperature`` (full softmax like the engine) from a *behaviour* copy of the policy
   that is ``staleness`` versions old (the real system is asynchronous); exact-match reward;
   group-normalised advantages ``(r - mean_g) / (std_g + eps)``; token-mean M2PO loss
   ``-sum(mask * ratio * A) / n_tokens`` (M2 masking of the highest ``(log ratio)^2`` tokens; with
   ``staleness 0`` it is the on-policy policy gradient); AdamW as ``M2POPolicy`` uses it
   (betas 0.9/0.999, no decay, grad-norm clip 1.0);
3. every ``eval_every`` steps: held-out avg@k (k=4) at temperature 1.0 and greedy accuracy,
   printed as JSON lines, then a summary per seed and over all seeds.

The defaults are the toy recipe's (warm start: ``astralight.tasks.warmstart`` defaults; RL: lr
5e-4, n=8, 32 prompts per step, 200 steps, behaviour one version stale). Measured on two CPU
cores: held-out avg@4 0.23-0.26 after the warm start, >= 0.90 by step 75-100, 0.95-0.96 at step
200, for seeds 0, 1, 2; ~130 ms per simulated RL step.

Control (``--control shuffle``): rewards are permuted across the batch before the advantages, so
the loss keeps its shape but carries no information about correctness. If accuracy still rose,
the recipe would not prove that rewards reach the policy.

Timings are wall-clock on whatever CPU runs this (two shared cores here: noisy, other jobs can
slow a step 10x; read them as an order of magnitude). Run::

    python tests/benchmarks/bench_toy_rl_feasibility.py --seeds 0 1 2
    python tests/benchmarks/bench_toy_rl_feasibility.py --seeds 0 --control shuffle
    # sweeps: --cache-dir /tmp/ws reuses warm starts; --show-failures lists missed held-out prompts
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

import torch

from astralight.rewards.toy import ExactMatchReward
from astralight.tasks.arithmetic import ArithmeticSource
from astralight.tasks.warmstart import (
    DEFAULT_BATCH_SIZE, DEFAULT_LABEL_SMOOTHING, DEFAULT_LR, DEFAULT_SFT_STEPS, DEFAULT_SOURCE_KWARGS, PAD_ID,
    heldout_accuracy, sample_completions, train_warmstart,
)
from astralight.trainer.tinymodel import TinyModelSpec, build_tokenizer, save_model_folder


def completion_batch(prompt_ids: list[list[int]], completions: list[list[int]]):
    """Right-padded prompt+completion ids, attention mask, loss mask on the completion tokens."""
    rows = [p + c for p, c in zip(prompt_ids, completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        mask[i, len(p): len(p) + len(c)] = 1.0
    return ids, attn, mask[:, 1:]


def completion_logprobs(model, ids, attn):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def m2_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO: drop the tokens with the largest (log r)^2 until the rest's mean is <= threshold."""
    sq = (log_ratio.detach() ** 2)[mask > 0]
    if sq.numel() == 0 or float(sq.mean()) <= threshold:
        return mask
    order = torch.sort(sq, descending=True).values
    suffix_mean = order.flip(0).cumsum(0).flip(0) / torch.arange(len(order), 0, -1)
    k = int((suffix_mean > threshold).sum())  # number of top tokens to mask
    cutoff = order[k - 1] if k > 0 else float("inf")
    keep = ((log_ratio.detach() ** 2) < cutoff).float()
    return mask * keep


def run_one(args, seed: int) -> dict:
    torch.manual_seed(seed)
    spec = TinyModelSpec(seed=seed, **json.loads(args.spec))
    source_kwargs = {"min_operand": args.min_operand, "max_operand": args.max_operand, "ops": args.ops}
    t0 = time.monotonic()
    key = hashlib.sha256(json.dumps([asdict(spec), source_kwargs, args.sft_steps, args.sft_lr,
                                     args.sft_batch_size, args.label_smoothing, seed]).encode()).hexdigest()[:16]
    cached = Path(args.cache_dir) / key if args.cache_dir else None
    if cached is not None and (cached / "config.json").exists():
        from transformers import AutoModelForCausalLM
        policy, tok = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32), build_tokenizer()
        sft_s = float(json.loads((cached / "seconds.json").read_text()))
    else:
        policy, tok = train_warmstart(spec, source_kwargs, args.sft_steps, args.sft_lr,
                                      args.sft_batch_size, seed, label_smoothing=args.label_smoothing)
        sft_s = time.monotonic() - t0
        if cached is not None:
            save_model_folder(policy, tok, cached)
            (cached / "seconds.json").write_text(json.dumps(sft_s))
    ev = dict(source_kwargs=source_kwargs, k=args.eval_k, temperature=1.0,
              max_new_tokens=args.max_new_tokens, eval_size=args.eval_size)
    acc0 = heldout_accuracy(policy, tok, seed=10_000 + seed, **ev)
    greedy0 = heldout_accuracy(policy, tok, **{**ev, "k": 1, "temperature": 0})
    emit({"seed": seed, "phase": "warmstart", "seconds": round(sft_s, 1),
          "heldout_avg@k_t1": acc0, "heldout_greedy": greedy0})

    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    reward = ExactMatchReward()
    src = ArithmeticSource(split="train", seed=seed + 1, **source_kwargs)
    history: deque = deque(maxlen=args.staleness + 1)  # behaviour weights, oldest first
    behaviour = copy.deepcopy(policy).eval()
    gen = torch.Generator().manual_seed(seed)
    curve = [{"step": 0, "acc": acc0}]
    cursor, rl_s, ev_s = 0, 0.0, 0.0
    for step in range(1, args.steps + 1):
        ts = time.monotonic()
        history.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
        behaviour.load_state_dict(history[0])  # `staleness` versions old once the deque is full
        prompts = [src.get(cursor + i) for i in range(args.prompts_per_step)]
        cursor += args.prompts_per_step
        flat = [p for p in prompts for _ in range(args.n)]
        texts, comps = sample_completions(behaviour, tok, [p.prompt for p in flat],
                                          max_new_tokens=args.max_new_tokens,
                                          temperature=args.temperature, generator=gen)
        r = torch.tensor([reward(t, p.metadata) for t, p in zip(texts, flat)])
        if args.control == "shuffle":
            r = r[torch.randperm(len(r), generator=gen)]
        g = r.view(args.prompts_per_step, args.n)
        # population std, eps 1e-6: what the dataflow computes on ingest (astralight.rl.advantages)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True, correction=0) + 1e-6)).view(-1)
        prompt_ids = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in flat]
        ids, attn, mask = completion_batch(prompt_ids, comps)
        with torch.no_grad():
            lp_b = completion_logprobs(behaviour, ids, attn)
            if args.temperature != 1.0:
                raise SystemExit("--temperature other than 1.0 needs tempered logprobs; not simulated")
        lp = completion_logprobs(policy, ids, attn)
        log_ratio = (lp - lp_b) * mask
        keep = m2_mask(log_ratio, mask, args.m2_threshold) if args.staleness > 0 else mask
        ratio = torch.exp(log_ratio)
        loss = -(keep * ratio * adv[:, None]).sum() / mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.clip))
        opt.step()
        rl_s += time.monotonic() - ts
        if step % args.eval_every == 0 or step == args.steps:
            te = time.monotonic()
            acc = heldout_accuracy(policy, tok, seed=10_000 + seed + step, **ev)
            greedy = heldout_accuracy(policy, tok, **{**ev, "k": 1, "temperature": 0})
            ev_s += time.monotonic() - te
            curve.append({"step": step, "acc": acc})
            emit({"seed": seed, "phase": "rl", "step": step, "heldout_avg@k_t1": round(acc, 4),
                  "heldout_greedy": round(greedy, 4),
                  "train_reward": round(float(r.mean()), 4), "grad_norm": round(gnorm, 3),
                  "masked_frac": round(1 - float(keep.sum() / mask.sum()), 4),
                  "rl_seconds": round(rl_s, 1), "eval_seconds": round(ev_s, 1)})
    if args.show_failures:
        emit({"seed": seed, "phase": "failures", "heldout": failures(policy, tok, source_kwargs, args)})
    first90 = next((c["step"] for c in curve if c["acc"] >= 0.90), None)
    first85 = next((c["step"] for c in curve if c["acc"] >= 0.85), None)
    summary = {"seed": seed, "phase": "summary", "warmstart_seconds": round(sft_s, 1),
               "acc_step0": acc0, "acc_final": curve[-1]["acc"], "first_step_ge_0.85": first85,
               "first_step_ge_0.90": first90, "rl_seconds": round(rl_s, 1),
               "rl_ms_per_step": round(1000 * rl_s / args.steps, 1)}
    emit(summary)
    return summary


def failures(policy, tok, source_kwargs: dict, args) -> list:
    """Held-out prompts the policy gets wrong in more than half of 8 samples, with its greedy answer."""
    src = ArithmeticSource(split="eval", eval_size=args.eval_size, **source_kwargs)
    src.get(0)
    prompts = [src.get(i) for i in range(len(src))]
    texts, _ = sample_completions(policy.eval(), tok, [p.prompt for p in prompts for _ in range(8)],
                                  max_new_tokens=args.max_new_tokens, generator=torch.Generator().manual_seed(1))
    greedy, _ = sample_completions(policy, tok, [p.prompt for p in prompts],
                                   max_new_tokens=args.max_new_tokens, temperature=0)
    out = []
    for i, p in enumerate(prompts):
        acc = sum(t.strip() == p.metadata["answer"] for t in texts[8 * i: 8 * i + 8]) / 8
        if acc <= 0.5:
            out.append(f"{p.prompt}{p.metadata['answer']} acc={acc} greedy={greedy[i]!r}")
    return out


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--spec", default="{}", help="JSON of TinyModelSpec overrides (seed is per run)")
    p.add_argument("--min-operand", type=int, default=DEFAULT_SOURCE_KWARGS["min_operand"])
    p.add_argument("--max-operand", type=int, default=DEFAULT_SOURCE_KWARGS["max_operand"])
    p.add_argument("--ops", default=DEFAULT_SOURCE_KWARGS["ops"])
    p.add_argument("--sft-steps", type=int, default=DEFAULT_SFT_STEPS)
    p.add_argument("--sft-lr", type=float, default=DEFAULT_LR)
    p.add_argument("--sft-batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--label-smoothing", type=float, default=DEFAULT_LABEL_SMOOTHING)
    p.add_argument("--cache-dir", default="", help="reuse warm-started models saved here (sweeps)")
    p.add_argument("--lr", type=float, default=5e-4, help="RL AdamW learning rate (betas 0.9/0.999, no decay)")
    p.add_argument("--n", type=int, default=8, help="group size (samples per prompt)")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--staleness", type=int, default=1, help="behaviour policy is this many versions old")
    p.add_argument("--m2-threshold", type=float, default=0.04)
    p.add_argument("--clip", type=float, default=1.0, help="grad-norm clip")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--show-failures", action="store_true", help="list held-out prompts still failed")
    p.add_argument("--control", choices=["none", "shuffle"], default="none")
    args = p.parse_args(argv)
    emit({"phase": "config", **vars(args), "torch_threads": torch.get_num_threads()})
    summaries = [run_one(args, s) for s in args.seeds]
    emit({"phase": "all", "acc_step0": [s["acc_step0"] for s in summaries],
          "acc_final": [s["acc_final"] for s in summaries],
          "first_step_ge_0.90": [s["first_step_ge_0.90"] for s in summaries]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
