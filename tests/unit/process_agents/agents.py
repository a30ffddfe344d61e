"""Agents run out of process by tests/unit/test_agent_process.py (loaded by path in the agent
worker, never imported by a test module)."""

import asyncio
import json
import os
import sys
import time

import openai

MSGS = [{"role": "system", "content": "Answer with the number."},
        {"role": "user", "content": "123+456="}]


def keys_agent(task, base_url, api_key, model):
    """One call, then what it was given: the task's keys and the call's model."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=task["messages"])
    print("hello from", task["task_id"], "episode", task["episode"])
    sys.stderr.write("to stderr\n")
    os.write(1, b"raw fd 1 bytes\n")  # must not corrupt the protocol pipe
    return {"keys": sorted(task), "model": model}


def broken_agent(task, base_url, api_key, model):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=task["messages"])
    raise KeyError("no_such_tool")


def sleepy_agent(task, base_url, api_key, model, seconds=60.0):
    time.sleep(seconds)
    return "late"


async def async_sleepy_agent(task, base_url, api_key, model):
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        print("cancelled", task["episode"])
        raise
    return "late"


def dying_agent(task, base_url, api_key, model):
    """A task whose id starts with "die" kills the whole worker; the others answer."""
    if task["task_id"].startswith("die"):
        time.sleep(0.2)
        os._exit(7)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model=model, messages=task["messages"])
    return reply.choices[0].message.content


NOT_A_FUNCTION = 3
