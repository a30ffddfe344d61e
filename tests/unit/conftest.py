"""Fixtures shared by the unit tests of the RaaS's OpenAI-compatible endpoint and the agent
workflows (test_openai_endpoint.py, test_agent_process.py, test_agent_team.py): the tiny chat
tokenizer and a running endpoint, one of each per module. A module that defines its own ``tok``
or ``endpoint`` keeps it."""

from __future__ import annotations

import pytest

from astralight.raas.openai_endpoint import OpenAIEndpoint
from astralight.trainer.tinymodel import build_chat_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def endpoint():
    ep = OpenAIEndpoint().start()
    yield ep
    ep.close()
