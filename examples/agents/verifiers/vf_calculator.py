"""A `verifiers` (0.4.0, ``verifiers.v1``) environment for the calculator task: a taskset of
three-digit sums, a harness that runs the tool loop in-process with an ``add`` tool, and task
metrics. Imported only inside the example's own virtualenv (verifiers cannot be installed beside
vLLM: it pins ``openai<3`` and ``mcp==2.0.0``); nothing here imports astralight.

verifiers' loader finds a taskset by module name: ``vf.TasksetConfig(id="vf_calculator")`` imports
this module (its folder is on ``PYTHONPATH``) and takes the Taskset and Harness it exports in
``__all__``. The harness follows verifiers' contract for in-process loops: every model call goes
through the rollout's interception ``endpoint`` with its bearer ``secret`` (verifiers records the
trace there and relays the call to the model client, here astralight's endpoint), and ``launch``
returns a synthetic ``ProgramResult``.
"""

from __future__ import annotations

import json
import random

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI

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


def run_tool(name: str, arguments: str) -> str:
    """One tool call's result as text; a bad call becomes an error message to the model."""
    try:
        args = json.loads(arguments)
        if name != "add":
            return f"error: unknown tool {name!r}"
        return str(int(args["a"]) + int(args["b"]))
    except Exception as exc:  # noqa: BLE001 - the model reads the error and may recover
        return f"error: {type(exc).__name__}: {exc}"


class CalculatorData(vf.TaskData):
    """One sum: the prompt (``"123+456="``) only; the answer stays with astralight's reward."""


class CalculatorTask(vf.Task[CalculatorData]):
    """verifiers' per-trace signals (metrics: recorded on the trace, not the training reward,
    which astralight computes on the answer)."""

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(getattr(m, "tool_calls", None) or [])
                         for m in trace.messages if getattr(m, "role", "") == "assistant"))

    @vf.metric
    async def integer_answer(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip().isdigit())


class CalculatorConfig(vf.TasksetConfig):
    num_tasks: int = 16
    seed: int = 0


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    """Sums of two three-digit numbers (for ``vf-eval``; astralight sends its own tasks)."""

    def load(self) -> list[CalculatorTask]:
        rng = random.Random(self.config.seed)
        return [CalculatorTask(CalculatorData(
            prompt=f"{rng.randint(100, 999)}+{rng.randint(100, 999)}=",
            system_prompt=SYSTEM_PROMPT), self.config.task)
            for _ in range(self.config.num_tasks)]


class CalculatorHarnessConfig(vf.HarnessConfig):
    max_turns: int = 3
    max_tokens: int = 64


class CalculatorHarness(vf.Harness[CalculatorHarnessConfig]):
    """The tool loop, in-process: ask the model with the ``add`` tool, run the calls, send the
    results back as ``tool`` messages, stop at an answer without tool calls."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                     **kwargs) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        # the interception server runs on this process's busy event loop: the SDK's 5 s connect
        # timeout failed a few episodes on two loaded cores
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                             timeout=httpx.Timeout(600.0, connect=120.0))
        answer = ""
        try:
            for _ in range(self.config.max_turns):
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=TOOLS,
                    max_tokens=self.config.max_tokens)
                message = reply.choices[0].message
                if not message.tool_calls:
                    answer = message.content or ""
                    break
                messages.append({"role": "assistant", "content": message.content,
                                 "tool_calls": [c.model_dump() for c in message.tool_calls]})
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": run_tool(call.function.name,
                                                         call.function.arguments)})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout=answer, stderr="")


__all__ = ["CalculatorTaskset", "CalculatorHarness"]
