"""The calculator agent with its tool behind an MCP server: an OpenAI Agents SDK ``Agent`` whose
only tool comes from ``calculator_server.py`` over MCP (stdio), on the SDK's default provider.

Nothing here imports astralight. The tool server is one process for the whole RaaS, started on
the first episode and shared by every episode after it (as a deployed tool server is); the agent
is ``async def``, so every episode runs on the RaaS's one agent event loop, where that connection
lives. The tool's result reaches the model as the SDK sends any function output; the RaaS records
it as context (masked), never as trained tokens.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from agents import Agent, MaxTurnsExceeded, ModelSettings, RunConfig, Runner
from agents.mcp import MCPServerStdio
from agents.models.openai_provider import OpenAIProvider

INSTRUCTIONS = "Answer with the number."
SERVER = Path(__file__).with_name("calculator_server.py")
_server: MCPServerStdio | None = None
_lock = asyncio.Lock()


async def calculator_server() -> MCPServerStdio:
    """The shared MCP connection, opened on first use (on the agent loop)."""
    global _server
    async with _lock:
        if _server is None:
            server = MCPServerStdio(name="calculator",
                                    params={"command": sys.executable, "args": [str(SERVER)]},
                                    cache_tools_list=True, client_session_timeout_seconds=30)
            await server.connect()
            _server = server
    return _server


async def mcp_agent(task: dict, base_url: str, api_key: str, model: str, max_turns: int = 3,
                    max_tokens: int = 64) -> str:
    """Solve ``task["prompt"]`` (e.g. ``"123+456="``) with the MCP server's ``add``."""
    agent = Agent(name="calculator", instructions=INSTRUCTIONS, model=model,
                  mcp_servers=[await calculator_server()],
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
