"""The Workflow API: what a RaaS runs on the tasks it leases.

A workflow turns tasks into samples using the engines it is given; it owns the interaction
(single turn, multi turn with tools, several policies talking to each other) and the reward, and
nothing else: leasing, pushing and weight refresh belong to the RaaS service. Workflows are
plain classes named by import path in the RaaS config (``workflow: {class_path, init_args}``),
so a new one needs no change to the service.
"""

from __future__ import annotations

from typing import Any

from astralight.protocol import Sample, Task


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
