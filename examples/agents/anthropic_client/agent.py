"""The calculator agent written against the ``anthropic`` client (the Messages API), as
Claude-style harnesses and LiteLLM's ``anthropic/`` routes call a model.

Nothing here imports astralight. The agent declares an ``add`` tool in Anthropic's schema
(``input_schema``), runs it itself when the model answers with a ``tool_use`` block, sends the
result back as a ``tool_result`` block and returns the final text. The RaaS serves the Messages
API on each episode's path (the client appends ``/v1/messages`` to ``base_url`` and sends the key
as ``x-api-key``), on the same recorder as chat completions: the episode's calls merge into one
sample, the tool results masked.
"""

from __future__ import annotations

import anthropic

SYSTEM_PROMPT = "Answer with the number."
TOOLS = [{
    "name": "add",
    "description": "Add two integers exactly.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer", "description": "the first addend"},
                       "b": {"type": "integer", "description": "the second addend"}},
        "required": ["a", "b"],
    },
}]


def run_tool(name: str, args: dict) -> str:
    """One tool call's result as text; a bad call becomes an error message to the model."""
    try:
        if name != "add":
            return f"error: unknown tool {name!r}"
        return str(int(args["a"]) + int(args["b"]))
    except Exception as exc:  # noqa: BLE001 - the model reads the error and may recover
        return f"error: {type(exc).__name__}: {exc}"


def claude_style_agent(task: dict, base_url: str, api_key: str, model: str, max_turns: int = 3,
                       max_tokens: int = 64) -> str:
    """Solve ``task["prompt"]`` (e.g. ``"123+456="``) with the ``add`` tool; the final text."""
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": task["prompt"]}]
    for _ in range(max_turns):
        reply = client.messages.create(model=model, system=SYSTEM_PROMPT, tools=TOOLS,
                                       messages=messages, max_tokens=max_tokens)
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text")
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": run_tool(b.name, b.input)}
            for b in uses]})
    return ""
