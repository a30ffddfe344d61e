"""The warm start of the CPU search-agent recipe (``examples/search_agent``).

The world is :func:`astralight.agents.search.write_synthetic_qa`'s: fictional people, their
birthplaces, jobs and pets, one passage per fact. The tiny chat model cannot know any of it, but
it can copy: the scripted conversations (train questions only) are

    user: Where was Drakeal born?
    assistant: <tool_call>{"name": "search", "arguments": {"query": "Where was Drakeal born?"}}
               </tool_call>
    tool: (1) Drakeal was born in Drefale.
    assistant: Drefale

with the tool result produced by the same :class:`~astralight.agents.search.BM25Search` settings
the recipe's workflow uses (:data:`SEARCH_TOOL_ARGS`), so the warm start sees exactly the token
streams RL will.

``fresh_names`` gives every conversation a new made-up person (the name replaced in the
question, the query and the result). Cycled over the train people's names, the model memorised
them and put only 7.5% of held-out names into its query at temperature 1.0; with a new name each
time copying is the only way to lower the loss: 14-40% after 400 steps, 93% after 800
(``examples/search_agent/README.md``).

``search_share`` below 1 mixes in conversations that answer directly (right, as remembered), so
that the policy skips the search in some episodes and RL has a call rate to raise. Measured
with fresh names, half such conversations halved the copying practice and the copy never formed
in 800 steps (1-2% of queries named the person).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from astralight.agents.search import BM25Search, person_name, write_synthetic_qa
from astralight.agents.tools import Tool
from astralight.tasks.chat_warmstart import build_chat_policy
from astralight.tasks.qa import QASource
from astralight.tasks.tool_warmstart import tool_call_text
from astralight.tasks.sft_loop import Progress
from astralight.trainer.tinymodel import CHAT_MODEL_SPEC, TinyModelSpec

__all__ = ["SEARCH_SYSTEM_PROMPT", "SEARCH_TOOL_ARGS", "search_conversations",
           "build_search_policy"]

#: the recipe's system prompt (the chat template also announces the tools by name)
SEARCH_SYSTEM_PROMPT = "Search, then answer in a word."
#: the recipe's search tool settings besides the corpus (short results: a char-level model)
SEARCH_TOOL_ARGS: dict = {"k": 1, "max_chars": 80, "show_title": False, "min_score": 1.0}


def search_conversations(questions: str, tool: BM25Search, count: int | None = None,
                         search_share: float = 1.0, seed: int = 0,
                         system_prompt: str = SEARCH_SYSTEM_PROMPT,
                         fresh_names: bool = False) -> list[list[dict]]:
    """Scripted conversations over the QA file ``questions`` (cycled to ``count``):
    ``search_share`` of them search for the question and copy the answer from the result, the
    others answer directly. A question whose answer the search result does not hold is left out
    (the script would teach guessing). ``fresh_names``: each conversation's person (the
    question's HotpotQA ``supporting_facts`` title) is replaced by a new made-up name throughout,
    so no name repeats and the model learns to copy it rather than remember it."""
    if not 0.0 <= search_share <= 1.0:
        raise ValueError(f"search_share: must be in [0, 1], got {search_share}")
    source = QASource(questions, keep_supporting_facts=fresh_names)
    rng = np.random.default_rng([seed, 11])
    names = np.random.default_rng([seed, 13])
    scripts = []
    for i in range(len(source)):
        p = source.get(i)
        answer = p.metadata["answer"]
        result = tool(p.prompt)
        if answer not in result:
            continue
        head = [{"role": "system", "content": system_prompt}, {"role": "user", "content": p.prompt}]
        call = [{"role": "assistant",
                 "content": tool_call_text(tool.__name__, {"query": p.prompt})},
                {"role": "tool", "name": tool.__name__, "content": result}]
        person = _person_of(p, questions) if fresh_names else None
        scripts.append((head, call, answer, person))
    if not scripts:
        raise ValueError(f"questions: no question of {questions} has its answer in the search "
                         "result; check the corpus and the tool settings")
    count = len(scripts) if count is None else int(count)
    out = []
    for j in range(count):
        head, call, answer, person = scripts[j % len(scripts)]
        body = call if rng.random() < search_share else []
        conversation = head + body + [{"role": "assistant", "content": answer}]
        if person is not None:
            conversation = _renamed(conversation, person, person_name(names))
        out.append(conversation)
    return out


def _person_of(prompt, questions: str) -> str:
    """The person a question asks about: its ``supporting_facts`` title (HotpotQA layout)."""
    facts = prompt.metadata.get("supporting_facts") or []
    if not facts or not facts[0] or not isinstance(facts[0][0], str) or \
            facts[0][0] not in prompt.prompt:
        raise ValueError(f"fresh_names: question {prompt.prompt_id!r} of {questions} names no "
                         "person in its supporting_facts (HotpotQA layout, [[title, 0]], the "
                         "title in the question); write the file with write_synthetic_qa or set "
                         "fresh_names: false")
    return facts[0][0]


def _renamed(conversation: list[dict], old: str, new: str) -> list[dict]:
    """``conversation`` with every whole-word ``old`` replaced by ``new``."""
    pattern = re.compile(rf"\b{re.escape(old)}\b")
    return [{**m, "content": pattern.sub(new, m["content"])} for m in conversation]


def _chat_spec(spec: TinyModelSpec | dict | None) -> TinyModelSpec:
    """The tiny chat model's shape, with a recipe's overrides (a dict of TinyModelSpec fields)."""
    if spec is None or isinstance(spec, TinyModelSpec):
        return spec or CHAT_MODEL_SPEC
    unknown = set(spec) - {f.name for f in dataclasses.fields(TinyModelSpec)}
    if unknown:
        raise ValueError(f"spec: unknown TinyModelSpec fields {sorted(unknown)}")
    return dataclasses.replace(CHAT_MODEL_SPEC, **spec)


def build_search_policy(out_dir: str | Path, data_dir: str | Path, seed: int = 0,
                        n_people: int = 1000, eval_share: float = 0.1,
                        relations: list[str] | None = None, tool_args: dict | None = None,
                        search_share: float = 1.0, conversations: int = 4000,
                        fresh_names: bool = True,
                        spec: TinyModelSpec | dict | None = None, sft_steps: int = 600,
                        lr: float = 5e-3, batch_size: int = 32, progress: Progress | bool = True,
                        num_threads: int | None = 1) -> Path:
    """The search recipe's ``prepare`` step: write the synthetic world to ``data_dir``
    (``corpus.jsonl``, ``train.jsonl``, ``eval.jsonl``; see
    :func:`~astralight.agents.search.write_synthetic_qa`) and warm-start the tiny chat model on
    its train questions into ``out_dir``. ``tool_args`` must be the workflow's BM25Search
    arguments (default :data:`SEARCH_TOOL_ARGS`); ``spec`` overrides fields of the chat model's
    shape (:data:`~astralight.trainer.tinymodel.CHAT_MODEL_SPEC`); ``fresh_names``: a new
    made-up person in every conversation (see :func:`search_conversations`).

    Why 1,000 people: with a few hundred the model memorises the train people's names instead
    of learning to copy a name from the question into the query, and held-out questions fail.
    """
    paths = write_synthetic_qa(data_dir, seed=seed, n_people=n_people, eval_share=eval_share,
                               relations=relations)
    args = dict(SEARCH_TOOL_ARGS if tool_args is None else tool_args)
    tool = BM25Search(paths["corpus"], **args)
    schema = Tool(tool).schema
    shape = _chat_spec(spec)
    return build_chat_policy(
        out_dir, lambda: search_conversations(paths["train"], tool, conversations, search_share,
                                              seed, fresh_names=fresh_names), [schema],
        spec=shape, sft_steps=sft_steps, lr=lr, batch_size=batch_size, seed=seed,
        progress=progress, num_threads=num_threads,
        provenance={"task": "search_agent", "data_dir": str(data_dir), "n_people": n_people,
                    "eval_share": eval_share, "relations": relations, "tool_args": args,
                    "search_share": search_share, "fresh_names": fresh_names,
                    "spec": dataclasses.asdict(shape)})


#: the vocabulary of the model it builds, before it is built (astralight.launch.prepared_vocab_size)
build_search_policy.vocab_size = lambda spec=None, **_: _chat_spec(spec).vocab_size
