"""The calculator agent written with the OpenAI Agents SDK, on its default provider.

Nothing here imports astralight. An SDK ``Agent`` with one function tool (``add``) is run by
``Runner.run`` with the SDK's default model provider, ``OpenAIProvider(base_url, api_key)``: the
Responses API, and an HTTP client the SDK keeps per process. The agent is ``async def``, so the
RaaS runs every episode on its one agent event loop, where that shared client stays usable across
episodes (a loop per episode failed with "bound to a different event loop"). Each episode's own
``api_key`` keeps its calls in its own episode even on a client the SDK shares.

The tool's JSON schema is written out as the warm-started tiny model saw it in training
(``function_tool`` would derive one from the signature with other keys); a real model needs no
such care.
"""

from __future__ import annotations

import json

from agents import Agent, FunctionTool, MaxTurnsExceeded, ModelSettings, RunConfig, Runner
from agents.models.openai_provider import OpenAIProvider

INSTRUCTIONS = "Answer with the number."
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "description": "the first addend"},
                   "b": {"type": "integer", "description": "the second addend"}},
    "required": ["a", "b"],
}


async def _add(ctx, arguments: str) -> str:
    """The tool: exact integer addition; a bad call becomes an error message to the model."""
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except Exception as exc:  # noqa: BLE001 - the model reads the error and may recover
        return f"error: {type(exc).__name__}: {exc}"


ADD = FunctionTool(name="add", description="Add two integers exactly.",
                   params_json_schema=ADD_SCHEMA, on_invoke_tool=_add, strict_json_schema=False)


async def sdk_agent(task: dict, base_url: str, api_key: str, model: str, max_turns: int = 3,
                    max_tokens: int = 64) -> str:
    """Solve ``task["prompt"]`` (e.g. ``"123+456="``) with the ``add`` tool; the final output."""
    agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[ADD], model=model,
                  model_settings=ModelSettings(temperature=1.0, max_tokens=max_tokens))
    config = RunConfig(model_provider=OpenAIProvider(base_url=base_url, api_key=api_key),
                       tracing_disabled=True,
                       # a misspelt tool name goes back to the model as an error, as the other
                       # examples' tool runners do (the SDK's default raises ModelBehaviorError)
                       tool_not_found_behavior="return_error_to_model")
    try:
        result = await Runner.run(agent, task["prompt"], run_config=config, max_turns=max_turns)
    except MaxTurnsExceeded:  # the policy kept calling the tool: a wrong answer, not a crash
        return ""
    return str(result.final_output or "")
