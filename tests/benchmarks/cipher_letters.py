"""Where a structured-task policy stands, letter by letter: why a run plateaus (issue 36).

    python tests/benchmarks/cipher_letters.py INIT_FOLDER [SNAPSHOT.safetensors ...] [--json]

On :mod:`astralight.tasks.cipher` a run can stop short of 1.0 because the policy is sure of a
wrong digit for one letter: every word holding that letter fails in every sample, so its groups
have no reward variance and nothing trains it. This prints, for the warm start ``INIT_FOLDER``
and each snapshot (weights saved by ``bench_vs_trl.py`` in ``astra_snaps/`` and
``trl_snaps/``), the mean probability of the right digit at each letter's positions over the
eval words (teacher-forced), and for every letter under 0.5 the mean distribution over the ten
digits at the first position: how far the right digit is from being sampled. The table must be
the one the bench used (the default is the bench's ``structured`` table).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

DIGITS = "0123456789"
#: the bench's structured table (tests/benchmarks/bench_vs_trl.py TASKS["structured"]["table"])
TABLE = {"word_len": 3, "known_letters": 8, "seen_share": 0.5, "seed": 0}


def letter_table(init: Path, snapshot: Path | None, table: dict) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astralight.tasks.cipher import CipherSource, CipherTable

    model = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32)
    if snapshot is not None:
        model.load_state_dict({n: t.float() for n, t in load_file(str(snapshot)).items()}, strict=False)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(init))
    cipher = CipherTable(**table)
    src = CipherSource("eval", **table)
    digit_ids = [tok(d, add_special_tokens=False).input_ids[0] for d in DIGITS]
    right: dict[str, list[float]] = defaultdict(list)
    first: dict[str, list] = defaultdict(list)
    with torch.no_grad():
        for i in range(len(src)):
            p = src.get(i)
            word, answer = p.prompt[:-1], p.metadata["answer"]
            ids = tok(p.prompt + answer, return_tensors="pt").input_ids
            n = len(tok(p.prompt).input_ids)
            probs = torch.softmax(model(ids).logits[0].float(), -1)
            for j, letter in enumerate(word):
                right[letter].append(float(probs[n - 1 + j, ids[0, n + j]]))
            first[word[0]].append(probs[n - 1, digit_ids])
    rows = {}
    for letter in sorted(right):
        p_right = sum(right[letter]) / len(right[letter])
        row = {"digit": cipher.cipher[letter], "known": letter in cipher.known,
               "p_right": round(p_right, 6)}
        if p_right < 0.5 and first[letter]:
            dist = torch.stack(first[letter]).mean(0)
            row["first_position"] = {d: float(f"{v:.3g}") for d, v in zip(DIGITS, dist.tolist())}
        rows[letter] = row
    return {"snapshot": str(snapshot) if snapshot else None, "letters": rows,
            "stuck": [k for k, r in rows.items() if r["p_right"] < 0.5]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("init", type=Path, help="the warm-start model folder the run started from")
    ap.add_argument("snapshots", type=Path, nargs="*", help="safetensors snapshots (none: the warm start)")
    ap.add_argument("--table", type=json.loads, default=TABLE, help="the CipherTable kwargs, as JSON")
    ap.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    args = ap.parse_args(argv)
    for snap in args.snapshots or [None]:
        result = letter_table(args.init, snap, args.table)
        if args.json:
            print(json.dumps(result), flush=True)
            continue
        print(f"== {result['snapshot'] or 'warm start'}: stuck letters {result['stuck']}")
        for letter, row in result["letters"].items():
            extra = f"  first position: {row['first_position']}" if "first_position" in row else ""
            print(f"  {letter} -> {row['digit']} {'known' if row['known'] else '     '} "
                  f"p(right) {row['p_right']:.4g}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
