"""examples/tool_use/recipe.yaml is a valid recipe: the dataflow builds with the tool workflow's
name, the RaaS workflow is the tool agent with the calculator, its context holds an episode, and
the warm start's scripted conversations fit the tiny chat model and the engine."""

from __future__ import annotations

from pathlib import Path

from astralight.agents.tools import Tool
from astralight.agents.toy_tools import add
from astralight.dataflow.config import DataflowConfig, build_plugins
from astralight.launch.recipe import load_recipe
from astralight.raas.config import build_parser
from astralight.tasks.chat_warmstart import transcript_of
from astralight.tasks.tool_warmstart import TOOL_SYSTEM_PROMPT, tool_conversations
from astralight.trainer.tinymodel import CHAT_MODEL_SPEC, build_chat_tokenizer
from astralight.workflows.tool_agent import ToolAgentWorkflow

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tool_use" / "recipe.yaml"


def test_the_recipe_builds_the_tool_agent_on_the_calculator():
    recipe = load_recipe(RECIPE)
    df = DataflowConfig(**recipe["dataflow"])
    build_plugins(df)
    assert df.workflow == ToolAgentWorkflow.name
    raas = recipe["raas"][0]
    parser = build_parser()
    cfg = parser.parse_object({k: v for k, v in raas.items() if k != "engines"} | {"engines": {}})
    wf = parser.instantiate_classes(cfg).workflow
    assert isinstance(wf, ToolAgentWorkflow) and list(wf.toolbox.tools) == ["add"]
    assert wf.system_prompt == TOOL_SYSTEM_PROMPT  # the warm start's: the policy knows it
    assert wf.max_total_tokens <= raas["engines"]["policy"]["max_model_len"] <= CHAT_MODEL_SPEC.max_position_embeddings
    assert recipe["trainers"][0]["trainer"]["max_steps"] == recipe["stop"]["versions"]


def test_scripted_conversations_fit_the_episode_budget_and_mix_both_ways():
    recipe = load_recipe(RECIPE)
    budget = recipe["raas"][0]["workflow"]["init_args"]["max_total_tokens"]
    tok = build_chat_tokenizer()
    convs = tool_conversations(200, seed=0)
    lengths = [len(transcript_of(tok, c, [Tool(add).schema])) for c in convs]
    assert max(lengths) < budget
    calling = sum(any(m["role"] == "tool" for m in c) for c in convs) / len(convs)
    assert 0.2 < calling < 0.4  # DEFAULT_TOOL_SHARE 0.3: the warm start prefers neither way
