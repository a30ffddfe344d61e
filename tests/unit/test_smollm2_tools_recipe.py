"""examples/smollm2_math/tools.yaml is a valid recipe whose parts agree: the tool agent with the
calculator renders with chatml_tools, its system prompt and problems are the cold start's, and
an episode fits the engine."""

from __future__ import annotations

from pathlib import Path

from astralight.agents.chat_templates import load_chat_template
from astralight.dataflow.config import DataflowConfig, build_plugins
from astralight.launch.recipe import load_recipe
from astralight.raas.config import build_parser
from astralight.tasks.calculator_warmstart import SYSTEM_PROMPT
from astralight.workflows.tool_agent import ToolAgentWorkflow

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_math" / "tools.yaml"


def test_the_recipe_builds_the_calculator_agent_the_cold_start_taught():
    recipe = load_recipe(RECIPE)
    df = DataflowConfig(**recipe["dataflow"])
    build_plugins(df)
    assert df.workflow == ToolAgentWorkflow.name
    raas = recipe["raas"][0]
    parser = build_parser()
    cfg = parser.parse_object({k: v for k, v in raas.items() if k != "engines"} | {"engines": {}})
    wf = parser.instantiate_classes(cfg).workflow
    assert isinstance(wf, ToolAgentWorkflow) and list(wf.toolbox.tools) == ["calculator"]
    assert wf.chat_template == load_chat_template("chatml_tools")
    assert wf.system_prompt == SYSTEM_PROMPT  # the scripts' system turn
    # the cold start drew its problems from the task's own distribution
    source = recipe["dataflow"]["source"]["init_args"]
    taught = recipe["prepare"]["kwargs"]["source"]
    assert all(source[k] == v for k, v in taught.items()) and "split" not in taught
    assert wf.max_total_tokens <= raas["engines"]["policy"]["max_model_len"]
    assert recipe["trainers"][0]["trainer"]["max_steps"] == recipe["stop"]["versions"]
