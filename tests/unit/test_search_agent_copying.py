"""tests/benchmarks/search_agent_copying.py's episode flags: which episodes named the person,
got the person's passage, copied its value, and were paid through a stranger's passage."""

from __future__ import annotations

from tests.benchmarks.search_agent_copying import classify

PROMPT = ("<|im_start|>system\nSearch, then answer in a word.<|im_end|>\n"
          "<|im_start|>user\nWhere was Tarer born?<|im_end|>\n<|im_start|>assistant\n")


def _completion(query: str, result: str, answer: str) -> str:
    return ('<tool_call>{"name": "search", "arguments": {"query": "' + query + '"}}</tool_call>'
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n" + result + "\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n" + answer + "<|im_end|>")


def test_a_faithful_episode():
    flags = classify(PROMPT, _completion("Where was Tarer born?",
                                         "(1) Tarer was born in Trakrus.", "Trakrus"), 1.0)
    assert flags == {"query": 1.0, "names_person": 1.0, "result_about_person": 1.0,
                     "answer_from_result": 1.0, "reward": 1.0, "reward_from_stranger": 0.0}


def test_a_misspelt_name_paid_by_a_strangers_passage():
    flags = classify(PROMPT, _completion("Where was Tager born?",
                                         "(1) Saitrix was born in Deatrer.", "Deatrer"), 1.0)
    assert flags["names_person"] == flags["result_about_person"] == 0.0
    assert flags["answer_from_result"] == 1.0 and flags["reward_from_stranger"] == 1.0


def test_no_results_and_no_tool_call():
    flags = classify(PROMPT, _completion("Where was Tager born?",
                                         "no results for 'Where was Tager born?'", "x"), 0.0)
    assert flags["query"] == 1.0 and flags["result_about_person"] == 0.0
    assert flags["reward_from_stranger"] == 0.0
    bare = classify(PROMPT, "Trakrus<|im_end|>", 0.0)
    assert bare["query"] == 0.0 and bare["answer_from_result"] == 0.0
