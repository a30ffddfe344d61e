"""A calculator agent written only against the ``openai`` client: astralight trains it unchanged.

Nothing here imports astralight. The agent declares an ``add`` tool in the OpenAI ``tools``
schema, asks the model, runs the tool itself when the model calls it, sends the result back as a
``tool`` message, and returns the model's final answer. Point it at any OpenAI-compatible server
(``base_url``) and it runs there too; under ``astralight run examples/openai_agent/recipe.yaml``
the RaaS hands it the base_url of its OpenAI-compatible endpoint, which records every call's
tokens, log-probs and policy versions for training.
"""

from __future__ import annotations

import json

from openai import OpenAI

SYSTEM_PROMPT = "Answer with the number."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers exactly.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "description": "the first addend"},
                           "b": {"type": "integer", "description": "the second addend"}},
            "required": ["a", "b"],
        },
    },
}]


def add(a: int, b: int) -> int:
    """The tool: exact integer addition."""
    return int(a) + int(b)


def run_tool(name: str, arguments: str) -> str:
    """One tool call's result as text; a bad call becomes an error message to the model."""
    try:
        args = json.loads(arguments)
        if name != "add":
            return f"error: unknown tool {name!r}"
        return str(add(**args))
    except Exception as exc:  # noqa: BLE001 - the model reads the error and may recover
        return f"error: {type(exc).__name__}: {exc}"


def calculator_agent(task: dict, base_url: str, api_key: str, model: str,
                     max_turns: int = 3, max_tokens: int = 64) -> str:
    """Solve ``task["prompt"]`` (e.g. ``"123+456="``) with the ``add`` tool; return the answer."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task["prompt"]}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                               max_tokens=max_tokens, temperature=1.0)
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [call.model_dump() for call in message.tool_calls]})
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return ""
