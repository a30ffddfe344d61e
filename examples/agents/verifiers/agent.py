"""The agent astralight runs out of process, inside the example's virtualenv: one verifiers
episode of the ``vf_calculator`` environment per call, its model calls sent to astralight's
endpoint (``base_url`` / ``api_key`` / ``model``). Nothing here imports astralight.

The environment is built once per worker process and served (its interception server up) on the
worker's one event loop; every episode runs on it. verifiers reads a client's key from an
environment variable (``api_key_var``), and each astralight episode has its own key, so each
episode gets a variable of its own for the time it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os

import verifiers.v1 as vf

from vf_calculator import (SYSTEM_PROMPT, CalculatorConfig, CalculatorData,
                           CalculatorHarnessConfig, CalculatorTask)

_ENV: dict = {}
_IDS = itertools.count()


async def _serving_env(max_turns: int, max_tokens: int) -> vf.Env:
    """The environment, built and served once (episodes share its interception server)."""
    key = (max_turns, max_tokens)
    if key not in _ENV:
        lock = _ENV.setdefault("lock", asyncio.Lock())
        async with lock:
            if key not in _ENV:
                config = vf.SingleAgentEnvConfig(
                    taskset=CalculatorConfig(id="vf_calculator"),
                    agent=vf.AgentConfig(
                        harness=CalculatorHarnessConfig(id="vf_calculator", max_turns=max_turns,
                                                        max_tokens=max_tokens),
                        runtime=vf.SubprocessConfig()))
                env = vf.SingleAgentEnv(config)
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(env.serving())
                _ENV[key] = (env, stack)  # served until the worker exits
    return _ENV[key][0]


async def verifiers_agent(task: dict, base_url: str, api_key: str, model: str,
                          max_turns: int = 3, max_tokens: int = 64) -> str:
    """One verifiers episode on ``task["prompt"]``; its final reply is the answer."""
    env = await _serving_env(max_turns, max_tokens)
    key_var = f"ASTRALIGHT_EPISODE_KEY_{next(_IDS)}"
    os.environ[key_var] = api_key
    try:
        ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=base_url,
                                                                     api_key_var=key_var))
        episode = await env.run_episode(CalculatorTask(CalculatorData(
            prompt=task["prompt"], system_prompt=SYSTEM_PROMPT)), ctx)
    finally:
        os.environ.pop(key_var, None)
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if errors:
        raise RuntimeError(f"verifiers episode failed: {errors[0].type}: {errors[0].message}")
    [trace] = episode.traces
    print(f"verifiers metrics {trace.metrics}")
    return trace.last_reply
