"""A LangGraph team of two policies: a worker drafts the answer, a supervisor gives the team's.

Nothing here imports astralight. Each member is a LangChain ``ChatOpenAI`` (streaming on, as
LangChain apps often run) bound to the same ``add`` tool, naming its own ``model``; a LangGraph
``StateGraph`` runs the worker node, then the supervisor node. Point it at any OpenAI-compatible
server that serves both model names and it runs there too. Under
``astralight run examples/agents/team/recipe.yaml`` each call reaches the RaaS's endpoint, which
serves it with the engine of the model it names and records it under that policy: the worker's
calls train the worker, the supervisor's the supervisor, each by its own trainer.

Rewards (the workflow's ``agent_rewards``): the worker is paid for its own draft (its reward is
computed here, from the task's answer); the supervisor gets the shared team reward, the
workflow's ``ExactMatchReward`` of the team's answer. The team's answer is the supervisor's, or
the worker's draft when the supervisor gives no number. (A tiny model warm-started on single sums
cannot read a teammate's text, so the supervisor does not see the draft; a real supervisor would
get it in its messages.)
"""

from __future__ import annotations

from typing import TypedDict

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

SYSTEM_PROMPT = "Answer with the number."
#: the tool in the OpenAI schema, as examples/openai_agent/agent.py declares it (LangChain's
#: @tool would describe it in other words, which the warm-started tiny model never saw)
ADD_TOOL = {
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
}


def run_tool(name: str, args: dict) -> str:
    """One tool call's result as text; a bad call becomes an error message to the model."""
    try:
        if name != "add":
            return f"error: unknown tool {name!r}"
        return str(int(args["a"]) + int(args["b"]))
    except Exception as exc:  # noqa: BLE001 - the model reads the error and may recover
        return f"error: {type(exc).__name__}: {exc}"


def solve(llm, prompt: str, max_turns: int) -> str:
    """One member's tool loop: ask, run the ``add`` calls it makes, send the results back."""
    messages = [SystemMessage(SYSTEM_PROMPT), HumanMessage(prompt)]
    for _ in range(max_turns):
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return str(reply.content or "")
        for call in reply.tool_calls:
            messages.append(ToolMessage(run_tool(call["name"], call["args"]),
                                        tool_call_id=call["id"]))
    return ""


class TeamState(TypedDict, total=False):
    prompt: str
    draft: str
    answer: str


def build_team(base_url: str, api_key: str, supervisor: str, worker: str, max_turns: int,
               max_tokens: int):
    """The compiled graph: worker -> supervisor."""
    def member(model: str):
        return ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=1.0,
                          max_tokens=max_tokens, streaming=True, max_retries=0).bind_tools([ADD_TOOL])

    worker_llm, supervisor_llm = member(worker), member(supervisor)

    def work(state: TeamState) -> TeamState:
        return {"draft": solve(worker_llm, state["prompt"], max_turns)}

    def supervise(state: TeamState) -> TeamState:
        own = solve(supervisor_llm, state["prompt"], max_turns).strip()
        return {"answer": own if any(c.isdigit() for c in own) else state["draft"]}

    graph = StateGraph(TeamState)
    graph.add_node("worker", work)
    graph.add_node("supervisor", supervise)
    graph.add_edge(START, "worker")
    graph.add_edge("worker", "supervisor")
    graph.add_edge("supervisor", END)
    return graph.compile()


def team_agent(task: dict, base_url: str, api_key: str, model: str, worker: str = "worker",
               max_turns: int = 3, max_tokens: int = 64) -> dict:
    """Run the team on ``task["prompt"]`` (e.g. ``"123+456="``); ``model`` is the supervisor's
    name (the lead), ``worker`` the worker's. Returns the team's answer and the worker's own
    reward (its draft against the task's answer)."""
    team = build_team(base_url, api_key, model, worker, max_turns, max_tokens)
    out = team.invoke({"prompt": task["prompt"]})
    expected = str(task["metadata"].get("answer", "")).strip()
    return {"answer": out["answer"],
            "rewards": {worker: float(out["draft"].strip() == expected)}}
