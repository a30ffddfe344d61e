"""Where a search-agent run's rewards come from, per band of versions: does the query name the
person asked about, does the search result, does the answer copy the result -- and how much reward
came through a result about someone else (a lucky value)?

    python tests/benchmarks/search_agent_copying.py RUN_DIR [--band 10] [--json]

It reads the run's trained samples from the dataflow's SQLite (read-only) and decodes them with the
run's tokenizer (``RUN_DIR/models/init``). Written for ``examples/search_agent``, whose RL at
lr 5e-4 lost the warm start's name copying (16% of queries named the person at versions 0-9, 5%
at 10-19) while a quarter of the warm start's rewards were lucky values from a stranger's passage.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sqlite3
import sys
from pathlib import Path

#: the person a synthetic question asks about ("Where was Drakeal born?")
ASKED = re.compile(r"(?:of|was|does) ([A-Z][A-Za-z]+)")

KINDS = ("query", "names_person", "result_about_person", "answer_from_result", "reward",
         "reward_from_stranger")


def classify(prompt: str, completion: str, reward: float) -> dict[str, float]:
    """One episode's flags (``KINDS``) from its decoded prompt and completion (Qwen-style chat
    markup, as the tiny chat model's template writes it)."""
    users = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)
    question = users[-1] if users else ""
    asked = ASKED.search(question)
    name = asked.group(1) if asked else None
    query = re.search(r'"query": "(.*?)"', completion)
    result = re.search(r"<tool_response>\n\(1\) (.*?)\n", completion)
    answer = completion.rsplit("<|im_start|>assistant\n", 1)[-1].replace("<|im_end|>", "").strip()
    about = bool(result and name and name in result.group(1))
    return {
        "query": float(query is not None),
        "names_person": float(bool(query and name and name in query.group(1))),
        "result_about_person": float(about),
        "answer_from_result": float(bool(result and answer and answer in result.group(1))),
        "reward": float(reward),
        "reward_from_stranger": float(reward if result and not about else 0.0),
    }


def bands(run_dir: Path, band: int = 10) -> list[dict]:
    """The mean of each flag over the trained samples of each band of ``band`` versions."""
    from transformers import AutoTokenizer

    from astralight.protocol import decode

    tok = AutoTokenizer.from_pretrained(run_dir / "models" / "init")
    db = sqlite3.connect(f"file:{run_dir / 'dataflow' / 'dataflow.db'}?mode=ro", uri=True)
    sums: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for version, reward, blob in db.execute("SELECT min_version, reward, blob FROM samples"):
        sample = decode(blob)
        ids = list(sample.token_ids)
        flags = classify(tok.decode(ids[:sample.prompt_len]), tok.decode(ids[sample.prompt_len:]),
                         reward)
        row = sums[version // band]
        row["n"] += 1
        row.update(flags)
    return [{"versions": f"{b * band}-{b * band + band - 1}", "samples": int(c["n"]),
             **{k: round(c[k] / c["n"], 3) for k in KINDS}} for b, c in sorted(sums.items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--band", type=int, default=10, help="versions per row")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)
    for row in bands(args.run_dir, args.band):
        print(json.dumps(row) if args.json else
              "  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
