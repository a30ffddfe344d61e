"""Loaders for the data sets of the paper's experiments, given local copies of their files.

Each is a :class:`~astralight.tasks.data.source.FileSource` whose field mapping is preset to the
public release's columns (every other ``FileSource`` argument -- tokenizer, length filter, prompt
format, shuffle, limit -- passes through):

======================  ===================================================================
``DAPOMathSource``      DAPO-Math-17k (Parquet, verl layout): ``prompt[0].content`` (DAPO's
                        own "Answer:" instruction and the Dr. MAS copy's trailing "Let's
                        think step by step ... \\boxed{}" stripped by default), answer
                        ``reward_model.ground_truth``, id ``extra_info.index``; the release
                        repeats each prompt ~100 times, so rows are de-duplicated by id.
``DeepScaleRSource``    DeepScaleR-Preview-Dataset (JSON): ``problem``, ``answer``.
``DeepCoderSource``     DeepCoder-Preview-Dataset (Parquet per subset): ``problem``; ``tests``
                        normalised to stdin/stdout cases in ``metadata["hidden_tests"]`` for
                        :class:`~astralight.rewards.code.HiddenTestsReward`; call-based
                        problems skipped and counted, or (``functional: true``) kept as
                        function-call tests with a "write this function" prompt.
``AIME24Source`` ...    eval sets AIME 2024 / AIME 2025 / AMC / MATH-500 / Minerva-Math, any of
                        their public copies: the problem is the first of ``problem``,
                        ``Problem``, ``question``; the answer of ``answer``, ``Answer``,
                        ``solution`` (a boxed answer is taken out of a solution).
``MathEvalSuite``       several eval files at once, each tagged with its benchmark name.
======================  ===================================================================

Math prompts get :data:`MATH_TEMPLATE` (answer in ``\\boxed{}``, what
:class:`~astralight.rewards.math.MathVerifyReward` reads) unless ``prompt_template`` says otherwise.
"""

from __future__ import annotations

import re

from astralight.tasks.data.code_tests import call_prompt, kind_of_tests, normalize_tests
from astralight.tasks.data.fields import has_any, pick
from astralight.tasks.data.source import FileSource, MultiBenchmarkSource, SkipRow

__all__ = ["MATH_TEMPLATE", "CODE_TEMPLATE", "DAPOMathSource", "DeepScaleRSource",
           "DeepCoderSource", "MathEvalSource", "AIME24Source", "AIME25Source", "AMCSource",
           "MATH500Source", "MinervaSource", "MathEvalSuite", "EVAL_PRESETS"]

#: the math instruction of the DeepScaleR recipe: reason, then box the final answer
MATH_TEMPLATE = "{prompt} Let's think step by step and output the final answer within \\boxed{}."
#: a stdin/stdout program in one fenced block (what HiddenTestsReward extracts)
CODE_TEMPLATE = ("{prompt}\n\nWrite a Python 3 program that reads the input from standard input "
                 "and prints the answer to standard output. Give the complete program in a "
                 "single ```python code block.")

_DAPO_WRAPPER = re.compile(
    r"^\s*Solve the following math problem step by step\..*?\n\n(?P<problem>.*)\n\n"
    r"Remember to put your answer on its own line after \"Answer:\"\.?\s*$", re.DOTALL)
#: the trailing reasoning instruction of the Dr. MAS copy of DAPO (HF ``aaabiao/dapo_filter``),
#: which AstraFlow Appendix A.2 strips at load time: "Let's think step by step ... \\boxed{}". Appendix
#: A.9 gives the single-agent suffix verbatim, "Let's think step by step. Please put your final
#: answer within \\boxed{}."; the DeepScaleR wording ("... and output the final answer within
#: \\boxed{}.") matches too. Tolerant of whitespace and line breaks, of a typographic apostrophe,
#: of ``$\\boxed{}$``; anchored at the end, and the span between "step by step" and
#: ``\\boxed{}`` is at most 200 characters, so a problem that merely mentions the phrase keeps it.
_STEP_BY_STEP_SUFFIX = re.compile(
    r"\s*Let['\u2019]s\s+think\s+step\s+by\s+step\b"
    r"(?:(?!Let['\u2019]s\s+think)[\s\S]){0,200}?"
    r"\$?\\boxed\s*\{\s*\}\s*\$?\s*\.?\s*$", re.IGNORECASE)

PROBLEM_FIELDS = ["problem", "Problem", "question", "Question"]
ANSWER_FIELDS = ["answer", "Answer", "final_answer", "solution", "Solution"]
ID_FIELDS = ["id", "ID", "unique_id", "problem_id", "idx"]


class DAPOMathSource(FileSource):
    """DAPO-Math-17k and its Dr. MAS copy (HF ``aaabiao/dapo_filter``). ``strip_instruction``
    removes DAPO's "last line: Answer: $Answer" wrapper and the trailing "Let's think step by step
    ... \\boxed{}" suffix (AstraFlow A.2, following Dr. MAS), so :data:`MATH_TEMPLATE` or a
    workflow's role prompts own the answer format; with ``strip_instruction: false`` set
    ``prompt_template: "{prompt}"`` and the reward's ``answer_format: boxed_or_answer_line``."""

    def __init__(self, path: str | list[str], strip_instruction: bool = True,
                 prompt_field: str | list[str] = "prompt.0.content",
                 answer_field: str | list[str] = "reward_model.ground_truth",
                 id_field: str | list[str] | None = "extra_info.index",
                 dedupe_field: str | None = "extra_info.index",
                 prompt_template: str = MATH_TEMPLATE, benchmark: str | None = "dapo_math",
                 **kwargs):
        self.strip_instruction = strip_instruction
        super().__init__(path, prompt_field=prompt_field, answer_field=answer_field,
                         id_field=id_field, dedupe_field=dedupe_field,
                         prompt_template=prompt_template, benchmark=benchmark, **kwargs)

    def clean_prompt(self, text: str) -> str:
        """The bare problem: DAPO-Math-17k's "Solve ... Answer:" wrapper and the Dr. MAS copy's
        trailing "Let's think step by step ... \\boxed{}" suffix removed (either or both; text
        with neither is returned as is)."""
        if self.strip_instruction:
            m = _DAPO_WRAPPER.match(text)
            if m:
                text = m.group("problem").strip()
            stripped = _STEP_BY_STEP_SUFFIX.sub("", text, count=1).strip()
            if stripped:  # never strip a prompt down to nothing
                return stripped
        return text


class DeepScaleRSource(FileSource):
    """DeepScaleR-Preview-Dataset (``deepscaler.json``: ``problem``, ``answer``, ``solution``)."""

    def __init__(self, path: str | list[str], prompt_field: str | list[str] = "problem",
                 answer_field: str | list[str] = "answer", prompt_template: str = MATH_TEMPLATE,
                 benchmark: str | None = "deepscaler", **kwargs):
        super().__init__(path, prompt_field=prompt_field, answer_field=answer_field,
                         prompt_template=prompt_template, benchmark=benchmark, **kwargs)


class DeepCoderSource(FileSource):
    """DeepCoder-Preview-Dataset, any subset (``taco``, ``primeintellect``, ``lcbv5``,
    ``codeforces``; one subset folder or several files). Tests land in ``metadata[tests_key]``.

    Args:
        tests_field: column holding the tests (a JSON string in the release).
        max_tests: keep the first N tests of a problem (tests travel with every task).
        min_tests: skip problems with fewer usable tests.
        tests_key: metadata key (HiddenTestsReward's ``tests_key``).
        functional: keep call-based problems (TACO ``fn_name``, LiveCodeBench ``functional``,
            PrimeIntellect ``function_call``) as function-call tests; their prompt asks for the
            function (:func:`~astralight.tasks.data.code_tests.call_prompt`, with the row's
            ``starter_code``) instead of a stdin program. Keep false for workflows that run
            stdin programs only (code test generation refuses function-call tests).
    """

    def __init__(self, path: str | list[str], prompt_field: str | list[str] = "problem",
                 tests_field: str = "tests", prompt_template: str = CODE_TEMPLATE,
                 max_tests: int | None = None, min_tests: int = 1,
                 tests_key: str = "hidden_tests", benchmark: str | None = "deepcoder",
                 functional: bool = False, **kwargs):
        if min_tests < 1:
            raise ValueError(f"min_tests: must be >= 1, got {min_tests}")
        if max_tests is not None and max_tests < min_tests:
            raise ValueError(f"max_tests: must be >= min_tests ({min_tests}), got {max_tests}")
        self.tests_field, self.max_tests, self.min_tests = tests_field, max_tests, min_tests
        self.tests_key, self.functional = tests_key, functional
        self.extra_columns = (tests_field.split(".")[0], "metadata", "starter_code")
        super().__init__(path, prompt_field=prompt_field, answer_field=None,
                         prompt_template=prompt_template, benchmark=benchmark, **kwargs)

    def row_metadata(self, record: dict) -> dict:
        raw = pick(record, self.tests_field, "tests_field")
        tests, reason = normalize_tests(raw, self.max_tests, functional=self.functional,
                                        metadata=record.get("metadata"))
        if tests is None:
            raise SkipRow(reason)
        if len(tests) < self.min_tests:
            raise SkipRow("too_few_tests")
        return {self.tests_key: tests}

    def _build(self, record: dict, row: int, tag: str):
        prompt_id, prompt, metadata = super()._build(record, row, tag)
        tests = metadata.get(self.tests_key)
        if tests and kind_of_tests(tests) == "call":  # the stdin template asks for the wrong program
            problem = self.clean_prompt(pick(record, self.prompt_field, "prompt_field"))
            text = call_prompt(problem, tests[0]["fn_name"], record.get("starter_code") or "")
            prompt = text if self.prompt_format == "text" else prompt[:-1] + [
                {"role": "user", "content": text}]
        return prompt_id, prompt, metadata


class MathEvalSource(FileSource):
    """A math eval set in any of the common layouts: ``prompt_field`` / ``answer_field`` default
    to the first present of :data:`PROBLEM_FIELDS` / :data:`ANSWER_FIELDS`; ids from
    ``id``/``unique_id``/... when present, else ``{benchmark}:{row}``."""

    def __init__(self, path: str | list[str], prompt_field: str | list[str] | None = None,
                 answer_field: str | list[str] | None = None,
                 prompt_template: str = MATH_TEMPLATE, benchmark: str | None = None, **kwargs):
        super().__init__(path, prompt_field=prompt_field or list(PROBLEM_FIELDS),
                         answer_field=answer_field or list(ANSWER_FIELDS),
                         prompt_template=prompt_template, benchmark=benchmark, **kwargs)

    def _columns(self) -> set[str]:
        return super()._columns() | set(ID_FIELDS)

    def _build(self, record: dict, row: int, tag: str):
        prompt_id, prompt, metadata = super()._build(record, row, tag)
        if self.id_field is None and has_any(record, ID_FIELDS):
            prompt_id = str(pick(record, ID_FIELDS, "id_field"))
        return prompt_id, prompt, metadata


class AIME24Source(MathEvalSource):
    """AIME 2024 (e.g. ``id, problem, solution, answer, url, year``); benchmark ``aime24``."""

    def __init__(self, path: str | list[str], benchmark: str | None = "aime24", **kwargs):
        super().__init__(path, benchmark=benchmark, **kwargs)


class AIME25Source(MathEvalSource):
    """AIME 2025 (``problem``/``question``, ``answer``); benchmark ``aime25``."""

    def __init__(self, path: str | list[str], benchmark: str | None = "aime25", **kwargs):
        super().__init__(path, benchmark=benchmark, **kwargs)


class AMCSource(MathEvalSource):
    """AMC 2022-23 (``id, problem, answer`` -- a float in the release, 27.0 -> "27"); ``amc``."""

    def __init__(self, path: str | list[str], benchmark: str | None = "amc", **kwargs):
        super().__init__(path, benchmark=benchmark, **kwargs)


class MATH500Source(MathEvalSource):
    """MATH-500 (``problem, solution, answer, subject, level, unique_id``); ``math500``;
    ``subject`` and ``level`` are kept in the metadata."""

    def __init__(self, path: str | list[str], benchmark: str | None = "math500",
                 metadata_fields: dict[str, str] | None = None, **kwargs):
        if metadata_fields is None:
            metadata_fields = {"subject": "subject", "level": "level"}
        super().__init__(path, benchmark=benchmark, metadata_fields=metadata_fields, **kwargs)


class MinervaSource(MathEvalSource):
    """Minerva-Math (``question, answer``); benchmark ``minerva``."""

    def __init__(self, path: str | list[str], benchmark: str | None = "minerva", **kwargs):
        super().__init__(path, benchmark=benchmark, **kwargs)


#: benchmark name -> its loader, for :class:`MathEvalSuite`
EVAL_PRESETS = {"aime24": AIME24Source, "aime25": AIME25Source, "amc": AMCSource,
                "math500": MATH500Source, "minerva": MinervaSource}


class MathEvalSuite(MultiBenchmarkSource):
    """Several math eval files as one eval source: ``files: {benchmark: path}``.

    Known names (``aime24``, ``aime25``, ``amc``, ``math500``, ``minerva``) use their preset;
    any other name a :class:`MathEvalSource` with that benchmark name. The remaining arguments
    apply to every file (see :class:`FileSource`).
    """

    def __init__(self, files: dict[str, str], prompt_template: str = MATH_TEMPLATE,
                 prompt_format: str = "text", chat_template: bool = False,
                 system_prompt: str | None = None, tokenizer_path: str | None = None,
                 max_prompt_tokens: int | None = None):
        if not files:
            raise ValueError("files: give at least one {benchmark: path}")
        common = dict(prompt_template=prompt_template, prompt_format=prompt_format,
                      chat_template=chat_template, system_prompt=system_prompt,
                      tokenizer_path=tokenizer_path, max_prompt_tokens=max_prompt_tokens)
        sources = [EVAL_PRESETS.get(name, MathEvalSource)(path, benchmark=name, **common)
                   for name, path in files.items()]
        super().__init__(sources, names=list(files))
