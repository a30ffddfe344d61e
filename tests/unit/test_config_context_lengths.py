"""Every shipped RaaS config gives each engine a context (``max_model_len``) that holds the longest
prompt its workflow can build plus the tokens it may generate.

A prompt that does not fit is skipped (``encode_text_prompt`` returns None: a solver/verifier or
code retry silently does not happen) and one that nearly fits has its generation cut short
(``clamp_max_tokens``), so a too-small context changes the experiment without an error.

The bound is computed from the configs, per workflow, with the workflow's real templates and
sampling (the RaaS config is parsed and the workflow instantiated as ``astralight raas serve``
does):

- the task prompt is at most the train source's ``max_prompt_tokens`` (dataflow*.yaml of the same
  folder); the toy's synthetic arithmetic source (no filter) by its widest prompt;
- a template's own text costs at most its UTF-8 byte count in tokens (Qwen3's byte-level BPE: every
  token covers at least one byte);
- text a model generated and that is shown to a model again (an answer, a verdict) costs at most
  its ``max_tokens`` + :data:`RETOKENIZE_SLACK` (decoding then re-encoding is not the identity);
- a workflow that wraps a filled template as a user turn (``chat: true``) adds at most
  :data:`CHAT_OVERHEAD` tokens of chat template (Qwen3: 8 tokens for
  ``<|im_start|>user\\n ... <|im_end|>\\n<|im_start|>assistant\\n``, 14 with an empty think block);
- a code retry's failing cases are cut to ``max_shown_chars`` characters per field and counted a
  token per character (stdin/stdout test data is ASCII).

Eval sources are not length-filtered by the configs: the public math/code benchmarks they name are
short next to the train bound (an eval prompt that does not fit is skipped and logged).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RAAS_CONFIGS = sorted((ROOT / "configs").rglob("raas*.yaml"))
#: tokens a chat template adds around one user message (documented margin; Qwen3 uses 8-14)
CHAT_OVERHEAD = 64
#: re-tokenizing the decoded text of N generated tokens: at most N * (1 + this)
RETOKENIZE_SLACK = 0.02
#: the longest sandbox status name ("output_limit")
STATUS_CHARS = 16


def _template_cost(template: str, placeholder: re.Pattern) -> tuple[int, dict[str, int]]:
    """(tokens of the template's own text, {placeholder: occurrences})."""
    counts: dict[str, int] = {}
    for m in placeholder.finditer(template):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return len(placeholder.sub("", template).encode("utf-8")), counts


def _shown(max_tokens: int) -> int:
    """Tokens of generated text when it is tokenized again inside another prompt."""
    return math.ceil(max_tokens * (1 + RETOKENIZE_SLACK))


def _gen(*specs) -> int:
    return max(s.max_tokens for s in specs)


def _max_prompt_tokens(raas_path: Path) -> int:
    """The longest task prompt the dataflow configs next to ``raas_path`` can issue."""
    from astralight.dataflow.config import instantiate_plugin
    from astralight.tasks.arithmetic import ArithmeticSource
    from astralight.tasks.base import PromptSource
    from astralight.trainer.tinymodel import build_tokenizer

    dataflows = sorted(raas_path.parent.glob("dataflow*.yaml"))
    assert dataflows, f"{raas_path}: no dataflow*.yaml beside it to bound the prompt length"
    longest = 0
    for path in dataflows:
        spec = yaml.safe_load(path.read_text())["source"]
        limit = (spec.get("init_args") or {}).get("max_prompt_tokens")
        if limit is not None:
            longest = max(longest, int(limit))
            continue
        # no length filter: only the toy's synthetic source is bounded here, by its widest
        # prompt "<max_operand><op><max_operand>=" in the toy model's char-level tokenizer
        source = instantiate_plugin(spec, PromptSource, "source")
        assert isinstance(source, ArithmeticSource), (
            f"{path}: source.init_args.max_prompt_tokens is not set; set it (the context bound "
            "of the RaaS config next to it needs the longest prompt)")
        widest = f"{source.max_operand}{source.ops[0]}{source.max_operand}="
        longest = max(longest, len(build_tokenizer()(widest, add_special_tokens=False)
                                   ["input_ids"]))
    return longest


def worst_cases(config, prompt_tokens: int) -> list[tuple[str, str, int]]:
    """``(model_id, what, tokens)``: each engine's longest prompt plus its generation budget."""
    from astralight.workflows import code_testgen, solver_verifier
    from astralight.workflows.single_turn import SingleTurnWorkflow
    from astralight.workflows.tool_agent import ToolAgentWorkflow

    wf, P, O = config.workflow, prompt_tokens, CHAT_OVERHEAD
    if isinstance(wf, solver_verifier.SolverVerifier):
        ph = solver_verifier._PLACEHOLDER
        solver, verifier = wf.roles["solver"], wf.roles["verifier"]
        g_s = _gen(wf.sampling, wf.eval_sampling)
        g_v = _gen(wf.verifier_sampling, wf.verifier_eval_sampling)

        def prompt(name: str) -> int:
            own, n = _template_cost(wf.templates[name], ph)
            return (own + n.get("problem", 0) * P + n.get("answer", 0) * _shown(g_s)
                    + n.get("feedback", 0) * _shown(g_v) + (O if wf.chat else 0))

        return [(solver, "first attempt", prompt("solver") + g_s),
                (verifier, "verdict", prompt("verifier") + g_v),
                (solver, "retry", prompt("retry") + g_s)]
    if isinstance(wf, code_testgen.CodeSolverTestGen):
        ph = code_testgen._PLACEHOLDER
        solver, testgen = wf.roles["solver"], wf.roles["testgen"]
        g_s = _gen(wf.sampling, wf.eval_sampling)
        g_t = _gen(wf.testgen_sampling, wf.testgen_eval_sampling)
        chat = O if wf.chat else 0
        own, n = _template_cost(wf.templates["solver_prompt"], ph)
        solver_prompt = own + n.get("problem", 0) * P  # the filled solver prompt, {prompt}
        own, n = _template_cost(wf.templates["testgen_prompt"], ph)
        testgen_prompt = own + n.get("problem", 0) * P
        own, n = _template_cost(wf.templates["failure_format"], ph)
        field = wf.max_shown_chars + 3  # cut fields end in "..."
        one_case = (own + (n.get("input", 0) + n.get("expected", 0) + n.get("got", 0)) * field
                    + n.get("status", 0) * STATUS_CHARS)
        failures = wf.max_failures_shown * one_case + (wf.max_failures_shown - 1)  # "\n".join
        own, n = _template_cost(wf.templates["retry_prompt"], ph)
        retry_prompt = (own + n.get("problem", 0) * P + n.get("prompt", 0) * solver_prompt
                        + n.get("attempt", 0) * _shown(g_s) + n.get("failures", 0) * failures)
        out = [(solver, "program", solver_prompt + chat + g_s),
               (testgen, "test suite", testgen_prompt + chat + g_t)]
        if wf.retry:
            out.append((solver, "retry", retry_prompt + chat + g_s))
        return out
    if isinstance(wf, SingleTurnWorkflow):
        # the task prompt as the source measured it: text as is, or messages through the chat
        # template with the generation prompt (prompt_format: messages), what the engine gets
        return [(m, "completion", P + _gen(wf.sampling, wf.eval_sampling))
                for m in config.model_ids]
    if isinstance(wf, ToolAgentWorkflow):
        # an episode ends unanswered once it reaches max_total_tokens or the engine's context:
        # the context must hold max_total_tokens, and the first turn (system prompt, the tools'
        # JSON schemas as the template lists them, the question, one turn's max_tokens) must fit
        import json

        tools = len(json.dumps(wf.toolbox.schemas(), ensure_ascii=False).encode("utf-8"))
        first = len(wf.system_prompt.encode("utf-8")) + tools + P + O + _gen(wf.sampling,
                                                                              wf.eval_sampling)
        return [case for m in config.model_ids
                for case in ((m, "episode (max_total_tokens)", wf.max_total_tokens),
                             (m, "first turn", first))]
    raise AssertionError(f"{type(wf).__name__}: no context bound for this workflow here; add its "
                         "worst-case prompt to worst_cases() in this test")


def shortfalls(config, prompt_tokens: int) -> list[str]:
    out = []
    for model_id, what, need in worst_cases(config, prompt_tokens):
        have = (config.engines[model_id] or {}).get("max_model_len")
        assert have is not None, f"engines.{model_id}: set max_model_len (the bound needs it)"
        if need > have:
            out.append(f"engines.{model_id}.max_model_len={have} < {need} tokens for the "
                       f"worst-case {what} (prompt + max_tokens); raise it")
    return out


def _parse(path: Path):
    from raas.config import parse_config

    return parse_config(["--config", str(path)])


def test_configs_found():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in RAAS_CONFIGS}
    assert {"qwen3_8b/solver_verifier_math/raas.yaml",
            "qwen3_8b/code_solver_testgen/raas.yaml", "toy/raas.yaml"} <= names


@pytest.mark.parametrize("path", RAAS_CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_engine_holds_its_longest_prompt_and_generation(path, stand_in_search_corpora,
                                                             stand_in_model_config):
    config = _parse(stand_in_model_config(path))
    problems = shortfalls(config, _max_prompt_tokens(path))
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_bound_is_real():
    """The solver/verifier retry (problem 2,000 + answer 4,096 + feedback 4,096 + 4,096 new) does
    not fit the 8,192 tokens the solver engine once had; the verifier's 12,288 holds its prompt."""
    path = ROOT / "configs/qwen3_8b/solver_verifier_math/raas.yaml"
    config = _parse(path)
    cases = {(m, what): need for m, what, need in worst_cases(config, 2000)}
    retry = cases[("solver", "retry")]
    assert 2000 + 3 * 4096 < retry < 16384
    assert cases[("verifier", "verdict")] <= 12288
    config.engines["solver"] = {**config.engines["solver"], "max_model_len": 8192}
    assert any("engines.solver.max_model_len=8192" in p and "retry" in p
               for p in shortfalls(config, 2000))
    # the code retry shows the problem, the failing cases and generates again
    code = _parse(ROOT / "configs/qwen3_8b/code_solver_testgen/raas.yaml")
    cases = {(m, what): need for m, what, need in worst_cases(code, 6000)}
    assert cases[("solver", "retry")] > 6000 + 4096 + 3 * 3 * 300
