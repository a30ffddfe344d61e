"""The Workflow API: what a RaaS runs on the tasks it leases.

A workflow turns tasks into samples using the engines it is given; it owns the interaction
(single turn, multi turn with tools, several policies talking to each other) and the reward, and
nothing else: leasing, pushing and weight refresh belong to the RaaS service. Workflows are
plain classes named by import path in the RaaS config (``workflow: {class_path, init_args}``),
so a new one needs no change to the service.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from astralight.protocol import Sample, Task

log = logging.getLogger(__name__)


class Workflow:
    """Base class. ``name`` is matched against ``Task.workflow`` by the service."""

    name: str = ""

    def run(self, tasks: list[Task], engines: dict[str, Any]) -> dict[str, list[Sample]]:
        """Run every task of one lease cycle (batched) and return ``{task_id: samples}``.

        ``engines`` maps a key (the model_id for single-policy workflows) to an
        :class:`astralight.raas.engine.Engine`. Every task id must appear in the result.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement run(tasks, engines)")


def tokenize_prompt(tokenizer: Any, prompt: Any, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a task prompt: text, chat messages (chat template), or ready token ids."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise TypeError(
        f"task.prompt: expected text, chat messages [{{role, content}}] or token ids, "
        f"got {type(prompt).__name__}"
    )


def encode_text_prompt(engine: Any, text: str, chat: bool = False,
                       add_special_tokens: bool = False) -> list[int] | None:
    """Prompt ids of ``text`` (as one user message through the chat template when ``chat``), or
    None, logged, when the prompt leaves no room in the engine's ``max_model_len``."""
    prompt = [{"role": "user", "content": text}] if chat else text
    ids = tokenize_prompt(engine.tokenizer, prompt, add_special_tokens)
    limit = getattr(engine, "max_model_len", None)
    if not ids or (limit is not None and len(ids) >= limit):
        log.warning("prompt of %d tokens does not fit max_model_len=%s: %.60r", len(ids), limit,
                    text)
        return None
    return ids


def generate_round(engine: Any, model_id: str, jobs: list[tuple[Task, list[int], Any]],
                   sampling_for: Callable[[str], Any]) -> list[tuple]:
    """One step of a multi-step workflow: generate for every job, batched per sampling kind.

    ``jobs`` are ``(task, prompt_ids, key)``; ``sampling_for("train" | "eval")`` gives the
    sampling. Returns ``(key, prompt_ids, completion, version, sampling)`` per job, where version
    is the one stamped on the completion (concurrent cycles) or else the engine's.
    """
    by_kind: dict[str, list[tuple[Task, list[int], Any]]] = {}
    for job in jobs:
        by_kind.setdefault("eval" if job[0].kind == "eval" else "train", []).append(job)
    out = []
    for kind, batch in by_kind.items():
        sampling = sampling_for(kind)
        version = int(engine.version)
        comps = engine.generate([b[1] for b in batch], sampling)
        if len(comps) != len(batch):
            raise RuntimeError(f"engine {model_id!r} returned {len(comps)} completions for "
                               f"{len(batch)} prompts")
        out.extend((key, ids, c, version if c.version is None else c.version, sampling)
                   for (_, ids, key), c in zip(batch, comps))
    return out


def check_roles(workflow: str, roles: dict[str, str], tasks: list[Task],
                engines: dict[str, Any]) -> None:
    """Every role's model id has an engine here and is named by every task (a multi-policy
    workflow emits samples for each); KeyError naming the field and the fix otherwise."""
    for role, model_id in roles.items():
        if model_id not in engines:
            raise KeyError(f"roles.{role}: no engine for model id {model_id!r}; this RaaS "
                           f"serves {sorted(engines)}")
    for task in tasks:
        absent = [m for m in roles.values() if m not in task.model_ids]
        if absent:
            raise KeyError(f"task.model_ids: task {task.task_id} lists {task.model_ids} but "
                           f"{workflow} emits samples for {absent} too; add them to the "
                           "dataflow's model_ids")
