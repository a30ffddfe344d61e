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
streams RL will. ``search_share`` below 1 mixes in conversations that answer directly (right, as
remembered): at temperature 1.0 the policy then skips the search in some episodes, which the
exact-match reward pays far less often on held-out people, so RL has a call rate to raise as
well as an answer to sharpen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from astralight.agents.search import BM25Search, write_synthetic_qa
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
                         system_prompt: str = SEARCH_SYSTEM_PROMPT) -> list[list[dict]]:
    """Scripted conversations over the QA file ``questions`` (cycled to ``count``):
    ``search_share`` of them search for the question and copy the answer from the result, the
    others answer directly. A question whose answer the search result does not hold is left out
    (the script would teach guessing)."""
    if not 0.0 <= search_share <= 1.0:
        raise ValueError(f"search_share: must be in [0, 1], got {search_share}")
    source = QASource(questions)
    rng = np.random.default_rng([seed, 11])
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
        scripts.append((head, call, answer))
    if not scripts:
        raise ValueError(f"questions: no question of {questions} has its answer in the search "
                         "result; check the corpus and the tool settings")
    count = len(scripts) if count is None else int(count)
    out = []
    for j in range(count):
        head, call, answer = scripts[j % len(scripts)]
        body = call if rng.random() < search_share else []
        out.append(head + body + [{"role": "assistant", "content": answer}])
    return out


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
                        spec: TinyModelSpec | dict | None = None, sft_steps: int = 400,
                        lr: float = 5e-3, batch_size: int = 32, progress: Progress | bool = True,
                        num_threads: int | None = 1) -> Path:
    """The search recipe's ``prepare`` step: write the synthetic world to ``data_dir``
    (``corpus.jsonl``, ``train.jsonl``, ``eval.jsonl``; see
    :func:`~astralight.agents.search.write_synthetic_qa`) and warm-start the tiny chat model on
    its train questions into ``out_dir``. ``tool_args`` must be the workflow's BM25Search
    arguments (default :data:`SEARCH_TOOL_ARGS`); ``spec`` overrides fields of the chat model's
    shape (:data:`~astralight.trainer.tinymodel.CHAT_MODEL_SPEC`).

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
                                              seed), [schema],
        spec=shape, sft_steps=sft_steps, lr=lr, batch_size=batch_size, seed=seed,
        progress=progress, num_threads=num_threads,
        provenance={"task": "search_agent", "data_dir": str(data_dir), "n_people": n_people,
                    "eval_share": eval_share, "relations": relations, "tool_args": args,
                    "search_share": search_share, "spec": dataclasses.asdict(shape)})


#: the vocabulary of the model it builds, before it is built (astralight.launch.prepared_vocab_size)
build_search_policy.vocab_size = lambda spec=None, **_: _chat_spec(spec).vocab_size
