"""Does the search agent's warm start copy a name it has never seen into its query?

Builds the warm start of ``examples/search_agent`` with its prepare step
(``build_search_policy``: the synthetic world, the recipe's tool settings, 4,000 conversations,
batch 32, lr 5e-3, one thread) with or without ``fresh_names`` and for a number of steps, then samples its first assistant turn on held-out
questions with transformers (``--samples`` per question at temperature 1.0, and greedy) and
counts the queries that name the person asked about: the skill RL has to build on.

    python tests/benchmarks/search_warmstart_copy.py --fresh-names --sft-steps 400 [--layers 2]

Prints one JSON object: the settings, the seconds the warm start took, its loss every 50 steps
and the two copy rates. Held-out names are ones the warm start never saw; without fresh names
the model sees each train person's name ~14 times and can remember instead of copy.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from astralight.agents.chat import ChatTranscript
from astralight.agents.search import BM25Search
from astralight.agents.tools import Tool
from astralight.tasks.qa import QASource
from astralight.tasks.search_warmstart import (SEARCH_SYSTEM_PROMPT, SEARCH_TOOL_ARGS,
                                               build_search_policy)
from astralight.trainer.tinymodel import CHAT_MODEL_SPEC

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: make the tests package importable
    sys.path.insert(0, str(REPO))
from tests.benchmarks.search_agent_copying import ASKED  # noqa: E402


def names_person(text: str, name: str) -> bool:
    """Whether a generated turn's search query names ``name`` as a whole word."""
    return re.search(rf'"query": "[^"]*\b{re.escape(name)}\b', text) is not None


def copy_rates(model, tokenizer, questions: QASource, schema: dict, count: int, samples: int,
               seed: int) -> dict[str, float]:
    """The share of sampled (temperature 1.0) and greedy first turns whose query names the
    person, over the first ``count`` questions."""
    torch.manual_seed(seed)
    sampled = greedy = 0
    n = min(count, len(questions))
    for i in range(n):
        p = questions.get(i)
        name = ASKED.search(p.prompt).group(1)
        t = ChatTranscript(tokenizer, [{"role": "system", "content": SEARCH_SYSTEM_PROMPT},
                                       {"role": "user", "content": p.prompt}], [schema])
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=70, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, num_return_sequences=samples,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            best = model.generate(ids, max_new_tokens=70, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
        cut = ids.shape[1]
        sampled += sum(names_person(tokenizer.decode(row[cut:], skip_special_tokens=True), name)
                       for row in out)
        greedy += names_person(tokenizer.decode(best[0][cut:], skip_special_tokens=True), name)
    return {"query_names_person_t1": round(sampled / (n * samples), 3),
            "query_names_person_greedy": round(greedy / n, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fresh-names", action="store_true",
                    help="a new made-up person in every conversation (the recipe's setting)")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--layers", type=int, default=CHAT_MODEL_SPEC.num_hidden_layers)
    ap.add_argument("--seed", type=int, default=0, help="the world's and the warm start's seed")
    ap.add_argument("--questions", type=int, default=100, help="held-out questions probed")
    ap.add_argument("--samples", type=int, default=4, help="sampled turns per question")
    args = ap.parse_args(argv)
    if args.sft_steps < 1 or args.layers < 1 or args.questions < 1 or args.samples < 1:
        ap.error("--sft-steps, --layers, --questions and --samples: at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        losses: list[float] = []
        t0 = time.monotonic()
        folder = build_search_policy(  # the recipe's prepare step, its other settings as shipped
            Path(tmp) / "model", Path(tmp) / "data", seed=args.seed,
            fresh_names=args.fresh_names, spec={"num_hidden_layers": args.layers},
            sft_steps=args.sft_steps, num_threads=1,
            progress=lambda s, loss: losses.append(loss) if s % 50 == 0 else None)
        seconds = time.monotonic() - t0
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        schema = Tool(BM25Search(str(Path(tmp) / "data" / "corpus.jsonl"),
                                 **SEARCH_TOOL_ARGS)).schema
        rates = copy_rates(model, tokenizer, QASource(str(Path(tmp) / "data" / "eval.jsonl")),
                           schema, args.questions, args.samples, args.seed)
    print(json.dumps({"fresh_names": args.fresh_names, "sft_steps": args.sft_steps,
                      "layers": args.layers, "seed": args.seed, "warmstart_s": round(seconds, 1),
                      "loss_every_50": [round(x, 3) for x in losses], **rates}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
