"""A CLI harness: the episode from the environment, the task as JSON on stdin, the answer on
stdout (tests/unit/test_agent_process.py runs it as a command)."""

import json
import os
import sys
import time

task = json.load(sys.stdin)
mode = sys.argv[1] if len(sys.argv) > 1 else "answer"
print("episode", os.environ["ASTRALIGHT_EPISODE"], file=sys.stderr)
if mode == "hang":
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
import openai  # noqa: E402 - after the pid is written: a slow import must not race the timeout

client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                       messages=task["messages"])
if mode == "fail":
    print("Traceback: something broke", file=sys.stderr)
    sys.exit(4)
print(reply.choices[0].message.content)
print(json.dumps(sorted(task)), file=sys.stderr)
