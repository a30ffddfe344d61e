"""Prompt sources over local files: readers, field mapping, presets of the paper's data sets,
chat/tokens formats, length filtering, multi-benchmark eval sets (fixtures in the releases'
formats under tests/fixtures/datasets, made by make_fixtures.py there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from astralight.protocol import Task, decode, encode, expect
from astralight.tasks.data import (MATH_TEMPLATE, AIME24Source, AIME25Source, AMCSource,
                                   DAPOMathSource, DeepCoderSource, DeepScaleRSource,
                                   FileSource, MATH500Source, MathEvalSuite, MinervaSource,
                                   MultiBenchmarkSource)
from astralight.tasks.data.fields import render_template
from astralight.tasks.data.readers import read_records, require_pyarrow

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


def roundtrip(prompt) -> Task:
    """The prompt as the dataflow ships it: a Task through the msgpack codec."""
    task = Task(task_id="t", prompt=prompt.prompt, n=2, model_ids=["p"],
                metadata=dict(prompt.metadata))
    return expect(decode(encode(task)), Task)


# ---------------------------------------------------------------- presets of the paper's data

def test_dapo_math_dedupes_strips_its_instruction_and_maps_nested_fields():
    src = DAPOMathSource(str(FIX / "dapo_math_17k.parquet"))
    assert src.stats["rows"] == 6 and src.stats["duplicates"] == 3 and len(src) == 3
    first = src.get(0)
    assert first.prompt_id == "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"
    assert first.prompt == "Find $x$ if $2x + 3 = 11$. " + MATH_TEMPLATE.split("} ", 1)[1]
    assert "Answer:" not in first.prompt and "\\boxed{}" in first.prompt
    assert first.metadata == {"answer": "4", "benchmark": "dapo_math"}
    assert [src.get(i).metadata["answer"] for i in range(3)] == ["4", "11", "8"]  # file order
    raw = DAPOMathSource(str(FIX / "dapo_math_17k.parquet"), strip_instruction=False,
                         prompt_template="{prompt}")
    assert raw.get(0).prompt.startswith("Solve the following math problem step by step.")
    assert raw.get(0).prompt.endswith('after "Answer:".')


def test_dapo_filter_suffix_is_stripped_as_dr_mas_does():
    """AstraFlow A.2 (following Dr. MAS) strips the trailing "Let's think step by step ...
    \\boxed{}" of HF aaabiao/dapo_filter at load time so the workflow's role prompts own the
    answer format: A.9's wording and DeepScaleR's, a typographic apostrophe, extra whitespace and
    line breaks; a phrase inside the problem and a problem without the suffix stay as they are."""
    src = DAPOMathSource(str(FIX / "dapo_filter.parquet"), prompt_template="{prompt}")
    assert src.stats["duplicates"] == 1 and len(src) == 4
    got = {src.get(i).prompt_id: src.get(i).prompt for i in range(len(src))}
    assert got == {
        "f-0": "Find $x$ if $3x = 12$.",
        "f-1": "How many edges does a cube have?",
        "f-2": 'Alice writes $\\boxed{5}$ and says "Let\'s think step by step". What is $5 + 5$?',
        "f-3": "Compute $2^5$.",
    }
    assert src.get(0).metadata == {"answer": "4", "benchmark": "dapo_math"}
    # the shipped solver/verifier source: only the bare problem reaches {problem}
    kept = DAPOMathSource(str(FIX / "dapo_filter.parquet"), strip_instruction=False,
                          prompt_template="{prompt}")
    assert kept.get(1).prompt.rstrip().endswith("\\boxed{}.")
    # the default template adds exactly one instruction back (not two)
    default = DAPOMathSource(str(FIX / "dapo_filter.parquet"))
    assert all(default.get(i).prompt.count("step by step") == 1 for i in (0, 1, 3))


def test_dapo_suffix_strip_edge_cases():
    src = DAPOMathSource(str(FIX / "dapo_filter.parquet"), prompt_template="{prompt}")
    clean = src.clean_prompt
    # both instructions at once: DAPO-17k's wrapper around a problem with the suffix
    wrapped = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer.\n\nFind $y$. Let's think step by step. "
               "Please put your final answer within $\\boxed{}$.\n\nRemember to put your answer "
               "on its own line after \"Answer:\".")
    assert clean(wrapped) == "Find $y$."
    # a suffix alone is never stripped down to an empty prompt
    bare = "Let's think step by step. Please put your final answer within \\boxed{}."
    assert clean(bare) == bare
    # the instruction must close the prompt: text after \boxed{} keeps it
    mid = "Let's think step by step and output \\boxed{} at the end. Then add 1 to it."
    assert clean(mid) == mid
    # more than 200 characters between "step by step" and \boxed{}: not the instruction
    long = "Find z. Let's think step by step " + "x" * 250 + " \\boxed{}."
    assert clean(long) == long


def test_deepscaler_json_array_and_save_to_disk_dataset_dict():
    src = DeepScaleRSource(str(FIX / "deepscaler.json"))
    assert len(src) == 3
    assert src.get(1).metadata == {"answer": "\\frac{1}{4}", "benchmark": "deepscaler"}
    assert src.get(1).prompt.startswith("Write $0.25$ as a fraction. Let's think step by step")
    with pytest.raises(ValueError, match=r"split.*\['train', 'test'\]"):
        DeepScaleRSource(str(FIX / "deepscaler_hf"))
    train = DeepScaleRSource(str(FIX / "deepscaler_hf"), split="train")
    test = DeepScaleRSource(str(FIX / "deepscaler_hf"), split="test")
    assert [train.get(i).prompt for i in range(2)] == [src.get(i).prompt for i in range(2)]
    assert len(test) == 1 and test.get(0).metadata["answer"] == "3"


def test_deepcoder_subsets_normalise_tests_and_skip_call_based_problems():
    src = DeepCoderSource(str(FIX / "deepcoder" / "*" / "*.parquet"))
    # codeforces (1), lcbv5 (1 of 2), primeintellect (1 of 2), taco (1 of 2)
    assert len(src) == 4 and src.stats["skipped"] == 3
    assert src.drop_reasons == {"functional": 3}
    tests = {src.get(i).prompt.split("\n")[0]: src.get(i).metadata["hidden_tests"]
             for i in range(4)}
    assert tests["Read two integers a and b and print a + b."] == [
        {"input": "1 2\n", "output": "3\n"}, {"input": "10 -3\n", "output": "7\n"}]
    assert tests["Print the maximum of n integers."][1] == {"input": "1\n-4\n", "output": "-4\n"}
    assert tests["Print the string s reversed."] == [{"input": "abc\n", "output": "cba\n"}]
    assert all("```python" in src.get(i).prompt for i in range(4))
    one = DeepCoderSource(str(FIX / "deepcoder" / "taco"), max_tests=1)
    assert len(one) == 1 and len(one.get(0).metadata["hidden_tests"]) == 1
    with pytest.raises(ValueError, match="no usable row"):
        DeepCoderSource(str(FIX / "deepcoder" / "taco"), min_tests=3)


def test_deepcoder_tests_feed_the_hidden_tests_reward():
    from astralight.rewards.code import HiddenTestsReward

    src = DeepCoderSource(str(FIX / "deepcoder" / "taco"))
    metadata = roundtrip(src.get(0)).metadata  # as the RaaS receives it
    reward = HiddenTestsReward(limits={"wall_s": 10.0})
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    assert reward(right, metadata) == 1.0
    assert reward(wrong, metadata) == 0.0
    # verl-style data sets carry the tests as a JSON string
    assert reward(right, {"hidden_tests": json.dumps(metadata["hidden_tests"])}) == 1.0


@pytest.mark.parametrize("cls, name, n, ids, answers", [
    (AIME24Source, "aime24.parquet", 2, ["60", "61"], ["24", "20"]),
    (AIME25Source, "aime25.jsonl", 2, ["0", "1"], ["1001", "56"]),
    (AMCSource, "amc.parquet", 2, ["0", "1"], ["27", "3.75"]),  # floats in the release
    (MATH500Source, "math500.jsonl", 3, ["test/prealgebra/1.json", "test/algebra/2.json",
                                         "test/algebra/3.json"], ["\\frac{3}{4}", "(-1,3)", "7"]),
    (MATH500Source, "math500_hf", 3, ["test/prealgebra/1.json", "test/algebra/2.json",
                                      "test/algebra/3.json"], ["\\frac{3}{4}", "(-1,3)", "7"]),
    (MinervaSource, "minerva.jsonl", 2, ["minerva:0", "minerva:1"], ["60", "0.001"]),
])
def test_eval_set_loaders(cls, name, n, ids, answers):
    src = cls(str(FIX / name))
    assert len(src) == n
    assert [src.get(i).prompt_id for i in range(n)] == ids
    assert [src.get(i).metadata["answer"] for i in range(n)] == answers
    assert {src.get(i).metadata["benchmark"] for i in range(n)} == {src.benchmark}
    assert all(src.get(i).prompt.endswith("within \\boxed{}.") for i in range(n))
    if cls is MATH500Source:
        assert src.get(0).metadata["subject"] == "Prealgebra" and src.get(0).metadata["level"] == 1


def test_a_boxed_solution_serves_as_the_answer():
    src = FileSource(str(FIX / "math500.jsonl"), prompt_field="problem", answer_field="solution")
    assert src.get(0).metadata["answer"] == "\\frac34"


def test_multi_benchmark_eval_source_tags_every_prompt():
    suite = MathEvalSuite({"aime24": str(FIX / "aime24.parquet"),
                           "amc": str(FIX / "amc.parquet"),
                           "minerva": str(FIX / "minerva.jsonl"),
                           "mymath": str(FIX / "math500.jsonl")})
    assert len(suite) == 2 + 2 + 2 + 3
    names = suite.benchmark_names()
    assert [names[i] for i in range(len(suite))] == ["aime24"] * 2 + ["amc"] * 2 + \
        ["minerva"] * 2 + ["mymath"] * 3
    assert [suite.get(i).metadata["benchmark"] for i in range(len(suite))] == \
        [names[i] for i in range(len(suite))]
    ids = [suite.get(i).prompt_id for i in range(len(suite))]
    assert ids[:3] == ["aime24:60", "aime24:61", "amc:0"] and ids[4] == "minerva:0"
    assert len(set(ids)) == len(ids)
    assert suite.get(8).metadata["answer"] == "7"
    with pytest.raises(IndexError):
        suite.get(len(suite))
    with pytest.raises(ValueError, match="distinct"):
        MultiBenchmarkSource([AMCSource(str(FIX / "amc.parquet")),
                              AMCSource(str(FIX / "amc.parquet"))])
    with pytest.raises(ValueError, match="no benchmark name"):
        MultiBenchmarkSource([FileSource(str(FIX / "minerva.jsonl"), prompt_field="question")])


# ---------------------------------------------------------------- generic field mapping

def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"q": {"text": "What is 1+1?", "topic": "add"}, "sol": {"final": 2}, "uid": "a1",
         "difficulty": 3},
        {"q": {"text": "What is 2*3?", "topic": "mul"}, "sol": {"final": 6}, "uid": "a2"},
        {"q": {"topic": "broken"}, "sol": {"final": 0}, "uid": "a3"},
        {"q": {"text": "What is 9-4?", "topic": "sub"}, "sol": {"final": 5}, "uid": "a4"}]


def test_field_mapping_template_metadata_and_invalid_rows(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with caplog.at_level("WARNING"):
        src = FileSource(path, prompt_field="q.text", answer_field="sol.final", id_field="uid",
                         metadata_fields={"topic": "q.topic", "difficulty": "difficulty"},
                         prompt_template="[{q.topic}] {prompt} Put it in \\boxed{} or "
                                         "\\frac{a}{b}.",
                         benchmark="toy")
    assert len(src) == 3 and src.stats["invalid"] == 1  # the row without q.text
    assert src.drop_reasons == {"invalid: prompt_field: none of ['q.text'] found": 1}
    assert "{a}, {b}" in caplog.text  # LaTeX braces kept as written, named once in the log
    p = src.get(0)
    assert p.prompt_id == "a1"
    assert p.prompt == "[add] What is 1+1? Put it in \\boxed{} or \\frac{a}{b}."
    assert p.metadata == {"answer": "2", "topic": "add", "difficulty": 3, "benchmark": "toy"}
    assert "difficulty" not in src.get(1).metadata  # absent extra fields are left out
    p.metadata["answer"] = "changed"  # callers get copies
    assert src.get(0).metadata["answer"] == "2"


def test_mapping_errors_name_the_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match="answer_field"):
        FileSource(path, prompt_field="q.text", answer_field="solution")
    with pytest.raises(ValueError, match="prompt_format"):
        FileSource(path, prompt_format="chatml")
    with pytest.raises(ValueError, match="tokenizer_path"):
        FileSource(path, prompt_field="q.text", max_prompt_tokens=10)
    with pytest.raises(FileNotFoundError, match="path"):
        FileSource(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        FileSource(str(bad))
    assert render_template("{{prompt}} {prompt}", {"prompt": "x"}) == "{prompt} x"


def test_get_is_deterministic_and_shuffle_is_seeded(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    plain = FileSource(path)
    assert [plain.get(i).prompt for i in range(20)] == [f"p{i}" for i in range(20)]
    assert [plain.get(i).prompt_id for i in range(3)] == ["d:0", "d:1", "d:2"]
    a, b = FileSource(path, shuffle_seed=7), FileSource(path, shuffle_seed=7)
    order = [a.get(i).prompt for i in range(20)]
    assert order == [b.get(i).prompt for i in range(20)]
    file_order = [f"p{i}" for i in range(20)]
    assert sorted(order) == sorted(file_order) and order != file_order
    assert order != [FileSource(path, shuffle_seed=8).get(i).prompt for i in range(20)]
    limited = FileSource(path, shuffle_seed=7, limit=5)
    assert len(limited) == 5 and [limited.get(i).prompt for i in range(5)] == order[:5]
    with pytest.raises(IndexError):
        plain.get(20)


def test_dedupe_on_json_rows(tmp_path):
    rows = [{"prompt": "a", "answer": "1", "k": 1}, {"prompt": "b", "answer": "2", "k": 2},
            {"prompt": "a again", "answer": "1", "k": 1}]
    src = FileSource(write_jsonl(tmp_path / "d.jsonl", rows), dedupe_field="k")
    assert len(src) == 2 and src.stats["duplicates"] == 1


# ---------------------------------------------------------------- tokenizer: formats, filtering

@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """The tiny char-level tokenizer with a minimal chat template, saved to a folder."""
    from astralight.trainer.tinymodel import build_tokenizer

    tok = build_tokenizer()
    # only characters of the tiny vocabulary
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    tok.save_pretrained(path)
    plain = build_tokenizer()
    plain_path = tmp_path_factory.mktemp("tok") / "plain"
    plain.save_pretrained(plain_path)
    return str(path), str(plain_path)


def test_length_filter_counts_tokens_once(tmp_path, chat_tokenizer_dir, caplog):
    chat_dir, plain_dir = chat_tokenizer_dir
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "12345+67890=", "answer": "80235"},
            {"prompt": "9-4=", "answer": "5"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level("INFO"):
        src = FileSource(path, tokenizer_path=plain_dir, max_prompt_tokens=6)
    assert len(src) == 2 and src.stats["too_long"] == 1  # char tokens: 4, 12, 4
    assert [src.get(i).prompt for i in range(2)] == ["1+1=", "9-4="]
    assert "too_long=1" in caplog.text
    # counted as the chat template makes them: "user: 1+1=;assistant:" is 21 tokens, 29 for the
    # long one; the plain count keeps all three at 21
    assert len(FileSource(path, tokenizer_path=plain_dir, max_prompt_tokens=21)) == 3
    chat = FileSource(path, tokenizer_path=chat_dir, chat_template=True, max_prompt_tokens=21)
    assert len(chat) == 2 and chat.get(0).prompt == "1+1="  # still text: the workflow templates


def test_tokens_and_messages_formats(tmp_path, chat_tokenizer_dir):
    from transformers import AutoTokenizer

    chat_dir, plain_dir = chat_tokenizer_dir
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    tok = AutoTokenizer.from_pretrained(chat_dir)
    src = FileSource(path, prompt_format="tokens", chat_template=True, tokenizer_path=chat_dir,
                     system_prompt="be brief")
    ids = src.get(0).prompt
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert tok.decode(ids) == "system: be brief;user: 1+1=;assistant:"
    assert roundtrip(src.get(0)).prompt == ids  # token ids cross the wire as a list of ints
    plain = FileSource(path, prompt_format="tokens", tokenizer_path=plain_dir)
    assert tok.decode(plain.get(0).prompt) == "1+1="
    msgs = FileSource(path, prompt_format="messages", system_prompt="be brief")
    assert msgs.get(0).prompt == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "1+1="}]
    with pytest.raises(ValueError, match="chat_template"):
        FileSource(path, prompt_format="tokens", chat_template=True, tokenizer_path=plain_dir)
    with pytest.raises(ValueError, match="tokenizer_path"):
        FileSource(path, prompt_format="tokens")


# ---------------------------------------------------------------- optional dependencies

def test_missing_pyarrow_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    with pytest.raises(ImportError, match=r"astralight\[data\]"):
        require_pyarrow()
    with pytest.raises(ImportError, match=r"pip install 'astralight\[data\]'"):
        AMCSource(str(FIX / "amc.parquet"))
    assert len(AIME25Source(str(FIX / "aime25.jsonl"))) == 2  # JSON needs no pyarrow


def test_save_to_disk_folders_need_no_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    rows, dropped = read_records(FIX / "math500_hf", columns={"problem", "answer"})
    assert len(rows) == 3 and dropped == 0 and set(rows[0]) == {"problem", "answer"}


def test_sources_are_named_by_import_path_from_yaml():
    from astralight.dataflow.config import instantiate_plugin
    from astralight.tasks.base import PromptSource

    src = instantiate_plugin({"class_path": "astralight.tasks.data.DAPOMathSource",
                              "init_args": {"path": str(FIX / "dapo_math_17k.parquet"),
                                            "limit": 2, "shuffle_seed": 1}},
                             PromptSource, "source")
    assert isinstance(src, DAPOMathSource) and len(src) == 2
    suite = instantiate_plugin({"class_path": "astralight.tasks.data.MathEvalSuite",
                                "init_args": {"files": {"aime25": str(FIX / "aime25.jsonl"),
                                                        "minerva": str(FIX / "minerva.jsonl")}}},
                               PromptSource, "eval.source")
    assert suite.benchmark_names() == {0: "aime25", 1: "aime25", 2: "minerva", 3: "minerva"}
