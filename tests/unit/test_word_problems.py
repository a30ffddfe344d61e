"""WordProblemSource: chat prompts with checkable answers, a held-out eval split, bad input named."""

from __future__ import annotations

import pytest

from astralight.tasks.word_problems import INSTRUCTION, WordProblemSource


def _value(prompt) -> int:
    """The answer worked out from the problem's text (its two numbers and its verb)."""
    problem = prompt.metadata["problem"]
    a, b = [int(w) for w in problem.replace("?", " ").replace(".", " ").split() if w.isdigit()]
    if "bags" in problem:
        return a * b
    if "gave away" in problem or "took" in problem:
        return a - b
    return a + b


def test_prompts_are_chat_messages_whose_answer_the_problem_states():
    src = WordProblemSource("train", ops="+-*", seed=3)
    for i in range(200):
        p = src.get(i)
        assert isinstance(p.prompt, list) and p.prompt[-1]["role"] == "user"
        assert p.prompt[-1]["content"] == f"{p.metadata['problem']} {INSTRUCTION}"
        assert int(p.metadata["answer"]) == _value(p) >= 0


def test_a_system_prompt_comes_first_and_the_stream_is_seeded():
    a = WordProblemSource("train", system_prompt="Be brief.", seed=1)
    b = WordProblemSource("train", system_prompt="Be brief.", seed=1)
    assert [a.get(i).prompt for i in range(20)] == [b.get(i).prompt for i in range(20)]
    assert a.get(0).prompt[0] == {"role": "system", "content": "Be brief."}
    assert [a.get(i).prompt_id for i in range(20)] != [
        WordProblemSource("train", seed=2).get(i).prompt_id for i in range(20)]


def test_eval_problems_are_distinct_and_never_drawn_for_training():
    ev = WordProblemSource("eval", eval_size=50)
    ids = [ev.get(i).prompt_id for i in range(len(ev))]
    assert len(ids) == len(set(ids)) == 50
    train = {WordProblemSource("train").get(i).prompt_id for i in range(3000)}
    assert not train & set(ids)
    with pytest.raises(IndexError, match="eval prompt 50 out of range"):
        ev.get(50)


def test_only_the_asked_operations_are_drawn():
    src = WordProblemSource("train", ops="-")
    assert all("-" in src.get(i).prompt_id for i in range(100))


@pytest.mark.parametrize("kwargs, field", [
    ({"split": "test"}, "split"), ({"ops": "+/"}, "ops"), ({"min_operand": 5, "max_operand": 4}, "min_operand"),
    ({"max_factor": 1}, "max_factor"), ({"eval_share": 1.0}, "eval_share"), ({"eval_size": 0}, "eval_size"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WordProblemSource(**kwargs)
