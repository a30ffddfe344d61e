"""A tool-format cold start for a pretrained chat model: a few supervised steps on scripted
calculator episodes of the word-problem task, so that RL starts from a policy that calls the
tool some of the time.

Why: SmolLM2-135M-Instruct shown the calculator through the ``chatml_tools`` template wrote no
``<tool_call>`` in 16 sampled replies (temperature 0.7), nor in 16 more with a worked example
in the prompt (it imitated the format as ``<tool_response>``), and RL cannot reinforce what it
never samples.
Half the scripts call the calculator and copy its result; the other half answer directly
(their answers are right too), so the warm start teaches the format without deciding for the
policy whether calling pays: RL's reward decides that.

The episodes are laid out exactly as :class:`~astralight.workflows.tool_agent.ToolAgentWorkflow`
lays out RL's (:func:`astralight.tasks.chat_warmstart.encode_conversations` with the same
template), and only the assistant turns are trained. Full fine-tuning of every weight, with the
warm starts' optimiser and schedule (:func:`astralight.tasks.sft_loop.sft`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from astralight.agents.calculator import calculator
from astralight.agents.chat_templates import load_chat_template
from astralight.agents.tools import Tool
from astralight.tasks.chat_warmstart import Conversation, encode_conversations
from astralight.tasks.sft_loop import print_progress, sft
from astralight.tasks.word_problems import WordProblemSource

#: the system turn of the scripts and of the recipe's workflow (the tools section follows it)
SYSTEM_PROMPT = "You are a helpful assistant. Use the calculator for arithmetic."
_OPERANDS = re.compile(r"^wp\d+:(\d+)([-+*])(\d+)$")


def call_text(expression: str) -> str:
    """The assistant turn that calls the calculator, as the template's instructions ask."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'


def calculator_conversations(count: int, tool_share: float = 0.5, seed: int = 0,
                             system_prompt: str = SYSTEM_PROMPT,
                             source: dict | None = None) -> list[Conversation]:
    """``count`` scripted episodes on the train split of
    :class:`~astralight.tasks.word_problems.WordProblemSource` (``source``: its arguments):
    ``tool_share`` of them call the calculator with the problem's expression and answer with its
    result, the rest answer the number directly."""
    if count < 1:
        raise ValueError(f"count: at least 1, got {count}")
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share: must be in [0, 1], got {tool_share}")
    src = WordProblemSource("train", **(source or {}))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        p = src.get(i)
        a, op, b = _OPERANDS.match(p.prompt_id).groups()
        answer = p.metadata["answer"]
        head = [{"role": "system", "content": system_prompt}, *p.prompt]
        if rng.random() < tool_share:
            result = calculator(f"{a} {op} {b}")
            out.append(head + [{"role": "assistant", "content": call_text(f"{a} {op} {b}")},
                               {"role": "tool", "name": "calculator", "content": result},
                               {"role": "assistant", "content": f"The answer is {result}."}])
        else:
            out.append(head + [{"role": "assistant", "content": f"The answer is {answer}."}])
    return out


def warm_start_calculator(base: str | Path, out_dir: str | Path, conversations: int = 512,
                          tool_share: float = 0.5, sft_steps: int = 12, lr: float = 2e-5,
                          batch_size: int = 8, seed: int = 0, chat_template: str = "chatml_tools",
                          source: dict | None = None, progress: bool = True,
                          num_threads: int | None = 1) -> Path:
    """Fine-tune the model folder ``base`` on :func:`calculator_conversations` and save it at
    ``out_dir`` (which must not exist or be empty; written aside and renamed into place), with
    ``base``'s tokenizer, generation config and provenance, and ``warmstart.json``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out_dir: {out} exists and is not an empty folder; remove it or "
                              "pick another")
    base = Path(base)
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base))
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        convs = calculator_conversations(conversations, tool_share, seed, source=source)
        ids, attn, mask = encode_conversations(
            tokenizer, convs, [Tool(calculator).schema], model.config.max_position_embeddings,
            chat_template=load_chat_template(chat_template))
        sft(model, ids, attn, mask, torch.zeros_like(mask), torch.tensor([0]), sft_steps, lr,
            batch_size, seed, 0.0, print_progress(sft_steps) if progress else None)
    finally:
        torch.set_num_threads(threads)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for name in ("generation_config.json", "pretrained.json"):  # eos/pad ids; where it came from
        if (base / name).is_file():
            shutil.copyfile(base / name, tmp / name)
    record = {"base": str(base), "conversations": conversations, "tool_share": tool_share,
              "sft_steps": sft_steps, "lr": lr, "batch_size": batch_size, "seed": seed,
              "chat_template": chat_template, "longest_tokens": int(attn.sum(-1).max())}
    (tmp / "warmstart.json").write_text(json.dumps(record, indent=2))
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def prepare_smollm2_calculator(out_dir: str | Path, **kwargs) -> Path:
    """A recipe ``prepare`` function: SmolLM2-135M-Instruct (converted once per machine,
    :func:`astralight.pretrained.prepare_smollm2`) after :func:`warm_start_calculator`
    (``kwargs``: its arguments)."""
    from astralight.pretrained import convert_gguf, default_cache_dir, find_gguf, is_model_folder

    cache = default_cache_dir()
    if not is_model_folder(cache):
        convert_gguf(find_gguf(None, cache.parent), cache)
    return warm_start_calculator(cache, out_dir, **kwargs)


__all__ = ["calculator_conversations", "warm_start_calculator", "prepare_smollm2_calculator",
           "call_text", "SYSTEM_PROMPT"]
