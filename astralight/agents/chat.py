"""A conversation as the policy saw it, token by token (astralight/ARCHITECTURE.md rule 1: tokens
in, tokens out).

A :class:`ChatTranscript` starts from the chat template's rendering of the first messages (the
prompt, ending in the generation prompt ``<|im_start|>assistant\\n``), then grows by two moves:

- :meth:`ChatTranscript.add_completion`: the assistant turn exactly as generated -- its token ids
  (the stop token included), behaviour log-probs and per-token versions, loss mask 1. The model's
  tokens are never decoded and re-tokenized.
- :meth:`ChatTranscript.add_messages`: tool results, environment observations or user messages,
  as the template renders them after an assistant turn, loss mask 0: the end of the assistant
  turn the model did not write (Qwen3: the ``\\n`` after ``<|im_end|>``), the new messages, and
  the next generation prompt.

Why a rendering delta and not a re-render of the whole conversation: templates may render earlier
turns differently once later messages exist (Qwen3 drops the ``<think>`` part of assistant turns
before the last user message). The policy generated each turn from the context it had then, so
that context -- not a later re-rendering -- is what its log-probs belong to and what is trained.
The delta is what the template renders after a probe assistant turn (the conversation's system
message, one user message and that turn, then the new messages), so it never depends on how the
template renders earlier turns, nor on whether it renders the last assistant turn differently
from earlier ones (Qwen3 gives the last one an empty ``<think>`` block). Where
the template does not re-render earlier turns, the transcript equals the template's rendering of
the whole conversation (``tests/unit/test_chat_transcript.py`` checks both cases).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from astralight.protocol import Sample, Task

#: stands in for an assistant turn's text in the probe history (found again by search)
_PROBE_TEXT = "astralight-probe-7f3a"


class TemplateError(ValueError):
    """The chat template cannot be extended by appending (named in the message)."""


def render(tokenizer: Any, messages: Sequence[dict], tools: list | None = None,
           add_generation_prompt: bool = False, **template_kwargs: Any) -> str:
    """The chat template's text for ``messages`` (and ``tools``, as the template's ``tools``)."""
    if not getattr(tokenizer, "chat_template", None) and not template_kwargs.get("chat_template"):
        raise TemplateError("tokenizer: has no chat template; give the model folder a "
                            "tokenizer_config.json with chat_template, or use a text workflow")
    return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of template text (special tokens in it stay single tokens; nothing added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


class ChatTranscript:
    """One episode's token stream: prompt, assistant turns (trained), other messages (masked).

    Args:
        tokenizer: the policy engine's tokenizer (its chat template renders every message).
        messages: the first messages (system and user, or the task's chat prompt).
        tools: OpenAI-style tool schemas, given to the template as ``tools``.
        template_kwargs: extra template variables (e.g. ``enable_thinking=False`` for Qwen3).
    """

    def __init__(self, tokenizer: Any, messages: Sequence[dict], tools: list | None = None,
                 **template_kwargs: Any):
        if not messages:
            raise ValueError("messages: a conversation needs at least one message")
        self.tokenizer = tokenizer
        self.tools = list(tools or [])
        self.template_kwargs = template_kwargs
        self.messages: list[dict] = [dict(m) for m in messages]
        self.token_ids: list[int] = encode(tokenizer, self._render(self.messages, True))
        n = len(self.token_ids)
        self.prompt_len = n
        self.logprobs: list[float] = [0.0] * n
        self.loss_mask: list[int] = [0] * n
        self.versions: list[int] = [-1] * n
        self.completions = 0
        self._last_stop = ""  # the stop token text that ended the last assistant turn

    def __len__(self) -> int:
        return len(self.token_ids)

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return render(self.tokenizer, messages, self.tools, add_generation_prompt,
                      **self.template_kwargs)

    def _append(self, ids: list[int], logprobs: list[float], mask: int, versions: list[int]) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.loss_mask.extend([mask] * len(ids))
        self.versions.extend(versions)

    def add_completion(self, completion: Any, version: int, text: str) -> None:
        """Append one assistant turn as generated; ``text`` is its decoded content (stop token
        left out), recorded as the assistant message; ``version`` stamps tokens of an engine
        that gave no per-token versions."""
        ids = list(completion.token_ids)
        self._append(ids, [float(x) for x in completion.logprobs], 1,
                     list(completion.token_versions(version)))
        self.messages.append({"role": "assistant", "content": text})
        self.completions += 1
        stopped = completion.finish_reason == "stop" and ids
        self._last_stop = self.tokenizer.decode(ids[-1:]) if stopped else ""

    def add_messages(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Append ``messages`` (tool, user, ...) after the last assistant turn, as the template
        renders them there, with loss mask 0; returns the appended ids."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise TemplateError("add_messages: follows an assistant turn (add_completion first)")
        new = [dict(m) for m in messages]
        probe = [m for m in self.messages[:1] if m.get("role") == "system"]
        probe += [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE_TEXT}]
        after = self._render(probe + new, add_generation_prompt)
        at = after.rfind(_PROBE_TEXT)
        if at < 0:
            raise TemplateError(
                "chat template: an assistant turn's content does not appear in its rendering, so "
                "what follows it cannot be found; use a template that renders assistant content")
        # everything after the probe turn's content: its end of turn (less the stop token the
        # model wrote itself), the new messages, the next generation prompt
        tail = after[at + len(_PROBE_TEXT):]
        if self._last_stop and tail.startswith(self._last_stop):
            tail = tail[len(self._last_stop):]
        ids = encode(self.tokenizer, tail)
        self._append(ids, [0.0] * len(ids), 0, [-1] * len(ids))
        self.messages.extend(new)
        self._last_stop = ""
        return ids

    def sample(self, task: Task, model_id: str, sample_index: int, group_index: int,
               reward: float, role: str = "", metadata: dict | None = None) -> Sample:
        """The transcript as one :class:`Sample`, trimmed to end on the policy's last token
        (masked tokens after it carry no signal)."""
        trained = [i for i, m in enumerate(self.loss_mask) if m]
        if not trained:
            raise ValueError(f"task {task.task_id}: the transcript has no generated token")
        end = trained[-1] + 1
        return Sample(
            task_id=task.task_id,
            sample_index=sample_index,
            model_id=model_id,
            token_ids=np.asarray(self.token_ids[:end], dtype=np.int32),
            logprobs=np.asarray(self.logprobs[:end], dtype=np.float32),
            loss_mask=np.asarray(self.loss_mask[:end], dtype=np.uint8),
            versions=np.asarray(self.versions[:end], dtype=np.int32),
            reward=float(reward),
            prompt_len=self.prompt_len,
            group_index=group_index,
            role=role,
            metadata=dict(metadata or {}),
        )
