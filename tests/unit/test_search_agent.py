"""The search agent's parts: the BM25 tool, the QA prompt source, the EM/F1 rewards, the
synthetic world and its warm-start scripts, and one scripted tool-agent episode over them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from astralight.agents.search import BM25Search, read_corpus, synthetic_qa, write_synthetic_qa
from astralight.agents.tools import ToolBox, ToolCall, load_tool, parse_tool_calls
from astralight.rewards.qa import (QAExactMatchReward, QAF1Reward, exact_match, extract_answer,
                                   f1_score, normalize_answer)
from astralight.tasks.qa import QASource, detect_format, write_hotpotqa_corpus

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qa"
PASSAGES = [
    {"id": "a", "title": "Eiffel Tower",
     "text": "The Eiffel Tower is a wrought-iron tower in Paris."},
    {"id": "b", "title": "Big Ben", "text": "Big Ben is the nickname of the great bell in London."},
    {"id": "c", "title": "Paris", "text": "Paris is the capital of France, on the Seine."},
    {"id": "d", "title": "Tower Bridge", "text": "Tower Bridge crosses the Thames in London."},
]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def corpus(tmp_path) -> Path:
    return _jsonl(tmp_path / "corpus.jsonl", PASSAGES)


# ---------------------------------------------------------------------------------- the tool

def test_bm25_ranks_the_right_passage_first(corpus):
    tool = BM25Search(str(corpus), k=2)
    assert [p["id"] for p, _ in tool.retrieve("which bell is called Big Ben")][:1] == ["b"]
    assert tool.retrieve("capital of France")[0][0]["id"] == "c"
    hits = tool.retrieve("tower in London")  # both towers and both London passages score
    assert len(hits) == 2 and hits[0][1] >= hits[1][1] > 0
    text = tool("Paris, capital of France")
    assert text.splitlines() == ["(1) Paris: Paris is the capital of France, on the Seine.",
                                 "(2) Eiffel Tower: The Eiffel Tower is a wrought-iron tower in "
                                 "Paris."]  # k passages, best first


def test_bm25_result_text_options(corpus):
    tool = BM25Search(str(corpus), k=10, max_chars=12, show_title=False)
    out = tool("Eiffel")
    assert out == "(1) The Eiffel T..."  # only one passage matches; its text is cut at 12
    assert tool("zzz qqq") == "no results for 'zzz qqq'"
    assert tool("   ").startswith("no results")
    assert len(tool.retrieve("tower", k=10)) <= len(tool) == 4


@pytest.mark.parametrize("content, match", [
    (None, "does not exist"),
    ("", "holds no passage"),
    ('{"id": "x", "title": "t"}\n', "row 0 .* no 'text'"),
])
def test_bad_corpus_files_are_named(tmp_path, content, match):
    path = tmp_path / "c.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises((FileNotFoundError, ValueError), match=f"corpus: .*{match}"):
        BM25Search(str(path))


def test_corpus_defaults_and_bad_arguments(tmp_path, corpus):
    rows = read_corpus(_jsonl(tmp_path / "bare.jsonl", [{"text": "only text"}]))
    assert rows == [{"id": "0", "title": "", "text": "only text"}]
    with pytest.raises(ValueError, match="k: must be >= 1"):
        BM25Search(str(corpus), k=0)
    with pytest.raises(ValueError, match="min_score: must be a BM25 score >= 0"):
        BM25Search(str(corpus), min_score=-1)


def test_min_score_keeps_a_misspelt_name_from_returning_a_stranger(tmp_path):
    """In the synthetic world a question shares one common word with a third of the corpus
    ("born"); with a misspelt name that word alone ranks some other person's passage first,
    whose value an exact-match reward pays by chance. Above the threshold only the name counts."""
    paths = write_synthetic_qa(tmp_path, seed=0, n_people=200, eval_share=0.2)
    row = json.loads(Path(paths["train"]).read_text().splitlines()[0])
    name = row["supporting_facts"][0][0]
    misspelt = row["question"].replace(name, name[:-1] + ("q" if name[-1] != "q" else "z"))
    loose = BM25Search(paths["corpus"], k=1, show_title=False)
    strict = BM25Search(paths["corpus"], k=1, show_title=False, min_score=1.0)
    assert row["answer"] in strict(row["question"]) == loose(row["question"])
    assert name not in loose(misspelt) and loose(misspelt).startswith("(1) ")  # a stranger
    assert strict(misspelt) == f"no results for {misspelt!r}"


def test_the_tool_loads_by_import_path_with_its_schema(corpus):
    tool = load_tool({"class_path": "astralight.agents.search.BM25Search",
                      "init_args": {"corpus": str(corpus), "k": 1}, "timeout_s": 3})
    assert tool.name == "search" and tool.timeout_s == 3
    fn = tool.schema["function"]
    assert fn["name"] == "search" and "passages" in fn["description"]
    assert fn["parameters"]["properties"] == {
        "query": {"type": "string", "description": "what to look for, e.g. a name or a question"}}
    assert fn["parameters"]["required"] == ["query"]
    renamed = load_tool({"class_path": "astralight.agents.search.BM25Search",
                         "init_args": {"corpus": str(corpus), "name": "wiki"}})
    assert renamed.name == "wiki" and renamed.schema["function"]["name"] == "wiki"


def test_toolbox_calls_the_search_and_reports_bad_arguments(corpus):
    import asyncio

    box = ToolBox([{"class_path": "astralight.agents.search.BM25Search",
                    "init_args": {"corpus": str(corpus), "k": 1}}])
    ok = asyncio.run(box.call(ToolCall("search", {"query": "Big Ben bell"})))
    assert ok.error is None and ok.content.startswith("(1) Big Ben:")
    bad = asyncio.run(box.call(ToolCall("search", {"q": "Big Ben"})))
    assert bad.error == "bad_arguments"


def test_concurrent_queries_get_the_answers_of_sequential_ones(corpus):
    tool = BM25Search(str(corpus), k=2)
    queries = ["Eiffel", "bell London", "capital France", "Thames bridge"] * 25
    expected = [tool(q) for q in queries]
    got: list = [None] * len(queries)

    def work(lo: int) -> None:
        for i in range(lo, len(queries), 4):
            got[i] = tool(queries[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


# ------------------------------------------------------------------------- the synthetic world

def test_synthetic_world_is_seeded_and_answerable_only_by_search(tmp_path):
    corpus, train, evals = synthetic_qa(seed=3, n_people=40, eval_share=0.25)
    assert synthetic_qa(seed=3, n_people=40, eval_share=0.25) == (corpus, train, evals)
    assert synthetic_qa(seed=4, n_people=40, eval_share=0.25)[0] != corpus
    assert len(corpus) == 120 and len(evals) == 30 and len(train) == 90
    assert not {q["title"] for q in train} & {q["title"] for q in evals}  # disjoint people
    paths = write_synthetic_qa(tmp_path, seed=3, n_people=40, eval_share=0.25)
    tool = BM25Search(paths["corpus"], k=1, show_title=False)
    for q in train + evals:  # the top passage holds the answer of every question
        assert tool(q["question"]).endswith(f" {q['answer']}.")
    with pytest.raises(ValueError, match="relations: unknown"):
        synthetic_qa(relations=["height"])


def test_written_world_reads_as_hotpotqa_train_and_bamboogle_eval(tmp_path):
    paths = write_synthetic_qa(tmp_path, seed=0, n_people=20)
    train, evals = QASource(paths["train"]), QASource(paths["eval"])
    assert list(train.formats.values()) == ["hotpotqa"]
    assert list(evals.formats.values()) == ["bamboogle"]
    assert len(train) + len(evals) == 60
    p = train.get(0)
    assert p.metadata["answers"] == [p.metadata["answer"]] and p.metadata["level"] == "easy"


# --------------------------------------------------------------------------- the QA source

def test_qa_source_reads_hotpotqa_json():
    src = QASource(str(FIXTURES / "hotpotqa_sample.json"), keep_supporting_facts=True)
    assert src.formats == {str(FIXTURES / "hotpotqa_sample.json"): "hotpotqa"} and len(src) == 3
    p = src.get(0)
    assert p.prompt_id == "5a8b57f25542995d1e6f1371"
    assert p.prompt == "Were Scott Derrickson and Ed Wood of the same nationality?"
    assert p.metadata["answer"] == "yes" and p.metadata["answers"] == ["yes"]
    assert p.metadata["type"] == "comparison" and p.metadata["level"] == "hard"
    assert p.metadata["supporting_facts"] == [["Scott Derrickson", 0], ["Ed Wood", 0]]
    assert "context" not in p.metadata  # large; not carried by every task
    plain = QASource(str(FIXTURES / "hotpotqa_sample.json"))
    assert "supporting_facts" not in plain.get(0).metadata


def test_qa_source_reads_bamboogle_and_flashrag_jsonl():
    bam = QASource(str(FIXTURES / "bamboogle_sample.jsonl"), prompt_template="Question: {prompt}")
    assert len(bam) == 3 and bam.get(1).prompt == (
        "Question: What rocket was the first spacecraft that ever approached Uranus launched on?")
    assert bam.get(1).metadata["answers"] == ["Titan IIIE"]
    assert bam.get(1).prompt_id == "bamboogle_sample:1"
    fr = QASource(str(FIXTURES / "flashrag_sample.jsonl"))
    assert fr.get(0).prompt_id == "test_0"
    assert fr.get(0).metadata["answers"] == ["Wilhelm Conrad Röntgen", "Wilhelm Röntgen"]
    assert fr.get(0).metadata["answer"] == "Wilhelm Conrad Röntgen"


def test_qa_source_detects_each_file_of_a_list():
    files = [str(FIXTURES / "hotpotqa_sample.json"), str(FIXTURES / "bamboogle_sample.jsonl")]
    src = QASource(files, benchmark="mixed")
    assert sorted(src.formats.values()) == ["bamboogle", "hotpotqa"] and len(src) == 6
    assert src.get(5).metadata == {"answer": "20 June 1837", "answers": ["20 June 1837"],
                                   "benchmark": "mixed"}


def test_qa_source_names_bad_fields(tmp_path):
    odd = _jsonl(tmp_path / "odd.jsonl", [{"query": "q?", "label": "a"}])
    with pytest.raises(ValueError, match=r"format: cannot tell .*fields \['label', 'query'\]"):
        QASource(str(odd))
    with pytest.raises(ValueError,
                       match=r"hotpotqa rows need .*lacks \['_id', 'question', 'answer'\]"):
        QASource(str(FIXTURES / "bamboogle_sample.jsonl"), format="hotpotqa")
    with pytest.raises(ValueError, match="format: one of auto"):
        QASource(str(FIXTURES / "bamboogle_sample.jsonl"), format="squad")
    with pytest.raises(ValueError, match="answer_field: set by the QA format"):
        QASource(str(FIXTURES / "bamboogle_sample.jsonl"), answer_field="x")
    with pytest.raises(ValueError, match="holds no question"):
        QASource(str(_jsonl(tmp_path / "empty.jsonl", [])))
    # a row without its answer is dropped and counted; no usable row at all is an error
    rows = [{"Question": "a?", "Answer": "x"}, {"Question": "b?", "Answer": ""},
            {"Question": "c?", "Answer": None}]
    src = QASource(str(_jsonl(tmp_path / "some.jsonl", rows)))
    assert len(src) == 1 and src.stats["invalid"] == 2
    assert any("answer_field" in r for r in src.drop_reasons)
    with pytest.raises(ValueError, match="answer_field"):
        QASource(str(_jsonl(tmp_path / "none.jsonl", rows[1:])))


def test_qa_source_passes_file_source_options_through():
    src = QASource(str(FIXTURES / "bamboogle_sample.jsonl"), prompt_format="messages",
                   system_prompt="Use the search tool.", limit=2, shuffle_seed=0)
    assert len(src) == 2
    assert src.get(0).prompt[0] == {"role": "system", "content": "Use the search tool."}
    assert src.get(0).prompt[1]["role"] == "user"


def test_detect_format_prefers_the_most_specific_layout():
    assert detect_format({"_id", "question", "answer", "context"}) == "hotpotqa"
    assert detect_format({"id", "question", "golden_answers"}) == "flashrag"
    assert detect_format({"Question", "Answer"}) == "bamboogle"


def test_hotpotqa_context_becomes_a_corpus(tmp_path):
    out = tmp_path / "corpus.jsonl"
    n = write_hotpotqa_corpus(str(FIXTURES / "hotpotqa_sample.json"), out)
    rows = read_corpus(out)
    assert n == len(rows) == 5  # Ed Wood appears twice; kept once (its first paragraph)
    by_title = {r["title"]: r["text"] for r in rows}
    assert by_title["Scott Derrickson"].endswith("He lives in Los Angeles, California.")
    assert by_title["Ed Wood"].startswith("Edward Davis Wood Jr. (October 10")
    tool = BM25Search(str(out), k=1)
    assert tool("ambassador to Ghana Chief of Protocol").startswith("(1) Shirley Temple:")


# ------------------------------------------------------------------------------ the rewards

@pytest.mark.parametrize("text, norm", [
    ("The Eiffel  Tower!", "eiffel tower"),
    ("  an apple, a pear ", "apple pear"),
    ("Theater", "theater"),  # an article only as a whole word
    ("U.S.A.", "usa"),
])
def test_normalize_answer(text, norm):
    assert normalize_answer(text) == norm


def test_exact_match_and_f1_values():
    assert exact_match("the Eiffel tower.", "Eiffel Tower") == 1.0
    assert exact_match("Eiffel", "Eiffel Tower") == 0.0
    assert exact_match("Wilhelm Röntgen", ["Wilhelm Conrad Röntgen", "wilhelm röntgen"]) == 1.0
    assert f1_score("Barack Obama", "Obama") == pytest.approx(2 / 3)
    assert f1_score("president Barack Obama", ["Obama", "Barack Obama"]) == pytest.approx(0.8)
    assert f1_score("Paris", "London") == 0.0
    assert f1_score("yes", "no") == 0.0 and f1_score("no", "No.") == 1.0
    assert f1_score("yes it is", "yes") == 0.0  # HotpotQA: yes/no answers must match exactly
    with pytest.raises(ValueError, match="no gold answer"):
        exact_match("x", [])


def test_rewards_read_answers_from_metadata_and_tags():
    meta = {"answer": "Chief of Protocol", "answers": ["Chief of Protocol", "chief of protocol"]}
    em, f1 = QAExactMatchReward(), QAF1Reward()
    assert em.cheap and f1.cheap
    assert em("chief of protocol", meta) == 1.0
    assert em("<think>hmm, the ambassador?</think>\nChief of Protocol.", meta) == 1.0
    assert f1("Protocol", meta) == pytest.approx(0.5)  # P 1, R 1/3
    assert em("Paris", {"answer": "paris"}) == 1.0  # the single-answer key as a fallback
    tagged = QAExactMatchReward(answer_tag="answer")
    assert tagged("<answer>x</answer> then <answer>Chief of Protocol</answer>", meta) == 1.0
    assert tagged("Chief of Protocol", meta) == 0.0  # no <answer> block: no answer
    assert extract_answer("<think>a</think> b <answer> c </answer>", "answer") == "c"
    with pytest.raises(KeyError, match="'answers'"):
        em("x", {"question": "q"})
    with pytest.raises(ValueError, match="answer_tag"):
        QAF1Reward(answer_tag="<answer>")


# ------------------------------------------------------------- warm start and one episode

def test_warmstart_scripts_search_then_copy_the_answer(tmp_path):
    from astralight.tasks.search_warmstart import SEARCH_TOOL_ARGS, search_conversations

    paths = write_synthetic_qa(tmp_path, seed=1, n_people=10)
    tool = BM25Search(paths["corpus"], **SEARCH_TOOL_ARGS)
    convs = search_conversations(paths["train"], tool, count=50, search_share=0.5, seed=0)
    assert len(convs) == 50
    searched = [c for c in convs if len(c) == 5]
    assert 10 < len(searched) < 40 and all(len(c) in (3, 5) for c in convs)
    for c in searched:
        _, user, call, result, answer = c
        (parsed,) = parse_tool_calls(call["content"])
        assert parsed.name == "search" and parsed.arguments == {"query": user["content"]}
        assert result["role"] == "tool" and result["content"] == tool(user["content"])
        assert answer["content"] in result["content"]


def test_fresh_names_give_every_conversation_a_new_person(tmp_path):
    """fresh_names: the person is renamed in question, query and result alike (the answer and
    the rest unchanged), no train person's name is left, and the names do not repeat; a file
    with no supporting_facts is refused naming the option."""
    from astralight.tasks.search_warmstart import SEARCH_TOOL_ARGS, search_conversations

    paths = write_synthetic_qa(tmp_path, seed=1, n_people=10)
    tool = BM25Search(paths["corpus"], **SEARCH_TOOL_ARGS)
    plain = search_conversations(paths["train"], tool, count=40, seed=0)
    fresh = search_conversations(paths["train"], tool, count=40, seed=0, fresh_names=True)
    train_names = {json.loads(line)["supporting_facts"][0][0]
                   for line in Path(paths["train"]).read_text().splitlines()}
    names = []
    for old, new in zip(plain, fresh):
        _, user, call, result, answer = new
        (old_name,) = [n for n in train_names if n in old[1]["content"]]
        (new_name,) = {w.strip("?") for w in user["content"].split()} - \
            {w.strip("?") for w in old[1]["content"].split()}
        assert not any(n in m["content"] for m in new for n in train_names)
        for before, after in zip(old, new):
            assert after["content"] == before["content"].replace(old_name, new_name)
        (parsed,) = parse_tool_calls(call["content"])
        assert parsed.arguments == {"query": user["content"]} and new_name in result["content"]
        assert answer == old[-1]
        names.append(new_name)
    assert len(set(names)) >= 38  # two-syllable names: a repeat now and then, not a cycle
    with pytest.raises(ValueError, match="fresh_names"):
        search_conversations(paths["eval"], tool, count=3, fresh_names=True)


def test_a_scripted_episode_searches_and_scores(tmp_path):
    """ToolAgentWorkflow with the search tool and a scripted engine: the call is run, its
    result is masked, the copied answer scores 1."""
    from astralight.engine import SamplingSpec
    from astralight.protocol import Task
    from astralight.tasks.search_warmstart import SEARCH_SYSTEM_PROMPT, SEARCH_TOOL_ARGS
    from astralight.tasks.tool_warmstart import tool_call_text
    from astralight.trainer.tinymodel import build_chat_tokenizer
    from astralight.workflows.tool_agent import ToolAgentWorkflow
    from tests.unit.engine_fakes import ScriptedEngine, run_tasks

    paths = write_synthetic_qa(tmp_path, seed=2, n_people=10)
    p = QASource(paths["eval"]).get(0)
    tok = build_chat_tokenizer()
    engine = ScriptedEngine(tok, [tool_call_text("search", {"query": p.prompt}),
                                  p.metadata["answer"]], version=5, max_model_len=512)
    wf = ToolAgentWorkflow(
        tools=[{"class_path": "astralight.agents.search.BM25Search",
                "init_args": {"corpus": paths["corpus"], **SEARCH_TOOL_ARGS}}],
        reward=QAExactMatchReward(), sampling=SamplingSpec(max_tokens=100), max_turns=3,
        system_prompt=SEARCH_SYSTEM_PROMPT)
    task = Task(task_id="t0", prompt=p.prompt, n=1, model_ids=["policy"], metadata=p.metadata)
    (s,) = run_tasks(wf, [task], {"policy": engine})["t0"]
    assert s.reward == 1.0 and s.metadata["tool_calls"] == 1 and s.metadata["end"] == "answer"
    text = tok.decode(list(s.token_ids))
    result = text.index("<tool_response>")
    assert p.metadata["answer"] in text[result:]
    masked = s.loss_mask[s.prompt_len:] == 0
    assert masked.any() and (s.versions[s.prompt_len:][masked] == -1).all()
    assert (s.versions[s.loss_mask == 1] == 5).all()


# ------------------------------------------------------------------------------- the recipe

def test_the_cpu_recipe_builds_and_matches_its_warm_start(tmp_path):
    """examples/search_agent/recipe.yaml: the dataflow's QA sources and the RaaS's workflow
    (with the search tool over the corpus the prepare step writes) build; the warm start
    scripts the tool settings and system prompt the workflow uses."""
    from astralight.dataflow.config import DataflowConfig, build_plugins, instantiate_plugin
    from astralight.launch.recipe import load_recipe, substitute
    from astralight.raas.config import build_parser
    from astralight.tasks.base import PromptSource
    from astralight.tasks.search_warmstart import SEARCH_SYSTEM_PROMPT
    from astralight.workflows.tool_agent import ToolAgentWorkflow

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "examples/search_agent/recipe.yaml")
    recipe = substitute(recipe, {"run_dir": tmp_path})
    prep = recipe["prepare"]
    assert prep["function"] == "astralight.tasks.search_warmstart.build_search_policy"
    write_synthetic_qa(prep["kwargs"]["data_dir"], seed=0, n_people=20)  # a small stand-in
    df = DataflowConfig(**recipe["dataflow"])
    build_plugins(df)
    assert df.workflow == "tool_agent"
    train = instantiate_plugin(df.source, PromptSource, "source")
    evals = instantiate_plugin(df.eval.source, PromptSource, "eval.source")
    assert list(train.formats.values()) == ["hotpotqa"]
    assert list(evals.formats.values()) == ["bamboogle"]
    parser = build_parser()
    raas = recipe["raas"][0]
    cfg = parser.parse_object({k: v for k, v in raas.items() if k != "engines"} | {"engines": {}})
    wf = parser.instantiate_classes(cfg).workflow
    assert isinstance(wf, ToolAgentWorkflow) and wf.name == df.workflow
    assert wf.system_prompt == SEARCH_SYSTEM_PROMPT
    (tool_spec,) = raas["workflow"]["init_args"]["tools"]
    args = {k: v for k, v in tool_spec["init_args"].items() if k != "corpus"}
    assert args == prep["kwargs"]["tool_args"]
    assert wf.max_total_tokens <= raas["engines"]["policy"]["max_model_len"] <= 512
    p = train.get(0)
    assert wf.toolbox.tools["search"].fn(p.prompt).endswith(f" {p.metadata['answer']}.")
