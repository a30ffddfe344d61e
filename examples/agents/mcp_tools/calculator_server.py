"""An MCP tool server (stdio) with one tool, ``add``: what examples/agents/mcp_tools/agent.py
connects to. A plain ``mcp`` (2.x) server; nothing here knows about astralight or RL."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers exactly."""
    return int(a) + int(b)


if __name__ == "__main__":
    server.run()  # stdio
