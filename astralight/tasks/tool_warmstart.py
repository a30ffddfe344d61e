"""The warm start of the toy tool-use recipe (``examples/tool_use``): three-digit sums, a tool.

The task is ``ArithmeticSource`` with operands 100..999 (``a+b=``), answered in a chat turn; the
tool is :func:`astralight.agents.toy_tools.add`. The tiny model cannot add three-digit numbers
reliably in its head, but it can copy: call ``add`` with the operands, then copy the tool's result.

Why a mixed warm start: RL must show both the tool-call rate and the accuracy *rising*, so the
warm start teaches both ways to answer and prefers neither. ``tool_share`` of its conversations
call the tool and copy the result; the others answer directly with the right sum, which the model
mostly gets wrong on held-out pairs. At temperature 1.0 the policy then calls the tool in about
``tool_share`` of its episodes; the exact-match reward pays those far more often, so RL raises
the call rate and the accuracy together.

Why some scripted tool results are random (``result_noise``): when every scripted result is the
true sum, the answer after a call is predictable from the prompt alone, and the model learns to
answer from the prompt (its weak arithmetic) instead of copying the result (measured: 0% right
after a call with 600 steps). In ``result_noise`` of the tool conversations the scripted ``add``
returns a random number and the answer copies it, so only copying fits them all. At RL time the
real tool returns the true sum, and the copy is right.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from astralight.agents.tools import Tool
from astralight.agents.toy_tools import add
from astralight.tasks.arithmetic import ArithmeticSource
from astralight.tasks.chat_warmstart import build_chat_policy
from astralight.tasks.sft_loop import Progress
from astralight.trainer.tinymodel import CHAT_MODEL_SPEC

#: the toy tool task's prompt source arguments (besides split/seed)
TOOL_SOURCE_KWARGS: dict = {"min_operand": 100, "max_operand": 999, "ops": "+"}
#: the system prompt of the recipe (the template also announces the tools)
TOOL_SYSTEM_PROMPT = "Answer with the number."
DEFAULT_TOOL_SHARE = 0.3
DEFAULT_RESULT_NOISE = 0.5


def tool_call_text(name: str, arguments: dict) -> str:
    """A Qwen3/Hermes tool call as the toy model writes it (no newlines: shorter)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def tool_conversations(count: int, tool_share: float = DEFAULT_TOOL_SHARE, seed: int = 0,
                       source_kwargs: dict | None = None,
                       result_noise: float = DEFAULT_RESULT_NOISE) -> list[list[dict]]:
    """``count`` scripted train-split conversations: ``tool_share`` of them call ``add`` and
    copy its result (a random number in ``result_noise`` of them), the rest answer directly
    (right)."""
    for name, value in (("tool_share", tool_share), ("result_noise", result_noise)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: must be in [0, 1], got {value}")
    src = ArithmeticSource(split="train", seed=seed, **(source_kwargs or TOOL_SOURCE_KWARGS))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        p = src.get(i)
        a, b = (int(x) for x in p.prompt.rstrip("=").split("+"))
        head = [{"role": "system", "content": TOOL_SYSTEM_PROMPT},
                {"role": "user", "content": p.prompt}]
        answer = str(p.metadata["answer"])
        if rng.random() < tool_share:
            result = str(add(a, b))
            if rng.random() < result_noise:
                result = str(int(rng.integers(200, 1999)))
            out.append(head + [
                {"role": "assistant", "content": tool_call_text("add", {"a": a, "b": b})},
                {"role": "tool", "name": "add", "content": result},
                {"role": "assistant", "content": result}])
        else:
            out.append(head + [{"role": "assistant", "content": answer}])
    return out


def build_tool_policy(out_dir: str | Path, conversations: int = 4000,
                      tool_share: float = DEFAULT_TOOL_SHARE,
                      result_noise: float = DEFAULT_RESULT_NOISE, sft_steps: int = 800,
                      lr: float = 5e-3, batch_size: int = 32, seed: int = 0,
                      progress: Progress | bool = True, num_threads: int | None = 1) -> Path:
    """The toy tool-use recipe's initial policy at ``out_dir`` (its ``prepare`` step)."""
    tools = [Tool(add).schema]
    return build_chat_policy(
        out_dir, lambda: tool_conversations(conversations, tool_share, seed,
                                            result_noise=result_noise), tools,
        sft_steps=sft_steps, lr=lr, batch_size=batch_size, seed=seed, progress=progress,
        num_threads=num_threads,
        provenance={"task": "tool_use", "tool_share": tool_share, "result_noise": result_noise,
                    "source_kwargs": TOOL_SOURCE_KWARGS})


#: the vocabulary of the model it builds, before it is built (astralight.launch.prepared_vocab_size)
build_tool_policy.vocab_size = lambda **_: CHAT_MODEL_SPEC.vocab_size
