"""Rewards for open-domain question answering: exact match and token F1 against gold answers.

The scores are the ones HotpotQA, Bamboogle, NQ/TriviaQA (and the search-agent papers that train
on them: Search-R1, ASearcher) report, with the SQuAD answer normalisation: lowercase, drop
punctuation, drop the articles ``a``/``an``/``the``, collapse whitespace. A question may have
several gold answers (aliases); the score is the best over them. Hand-written rather than taken
from a package because the official evaluation scripts are not packaged (``evaluate``'s ``squad``
metric downloads its script at run time, which a RaaS without internet cannot do); the functions
below follow HotpotQA's ``hotpot_evaluate_v1.py`` (its yes/no rule included).

The answer is read from the completion: the text after the last ``</think>`` (a reasoning
model's final part), and, with ``answer_tag`` (e.g. ``"answer"``, the ASearcher / Search-R1
convention), only what the last ``<answer>...</answer>`` holds -- a completion without one
scores 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any, Callable, Iterable

from astralight.rewards.base import Reward

__all__ = ["normalize_answer", "exact_match", "f1_score", "extract_answer", "gold_answers",
           "QAExactMatchReward", "QAF1Reward"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
#: HotpotQA: a yes/no/noanswer prediction scores F1 only when it equals the gold answer
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """SQuAD / HotpotQA normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(gold: str | Iterable[str]) -> list[str]:
    golds = [gold] if isinstance(gold, str) else [str(g) for g in gold]
    if not golds:
        raise ValueError("gold: no gold answer given")
    return golds


def exact_match(prediction: str, gold: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(g) for g in _golds(gold)) else 0.0


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: str | Iterable[str]) -> float:
    """Token-level F1 of the normalised prediction, the best over the gold answers."""
    return max(_f1(prediction, g) for g in _golds(gold))


def extract_answer(completion: str, answer_tag: str | None = None) -> str | None:
    """The answer part of ``completion``: after the last ``</think>``; with ``answer_tag`` the
    content of the last ``<tag>...</tag>`` (None when there is none)."""
    text = completion.rsplit("</think>", 1)[-1]
    if answer_tag is None:
        return text.strip()
    found = re.findall(rf"<{re.escape(answer_tag)}>(.*?)</{re.escape(answer_tag)}>", text,
                       re.DOTALL)
    return found[-1].strip() if found else None


def gold_answers(metadata: dict, answers_key: str = "answers",
                 answer_key: str = "answer") -> list[str]:
    """The gold answers of a task: ``metadata[answers_key]`` (a list or one string), else
    ``metadata[answer_key]``; a KeyError naming both keys when neither is there."""
    value: Any = metadata.get(answers_key)
    if value is None:
        value = metadata.get(answer_key)
    if value is None:
        raise KeyError(f"metadata: the QA reward needs {answers_key!r} (a list of gold answers) "
                       f"or {answer_key!r}, got {sorted(metadata)}")
    golds = [value] if isinstance(value, str) else [str(v) for v in value]
    if not golds:
        raise ValueError(f"metadata.{answers_key}: the list of gold answers is empty")
    return golds


class _QAReward(Reward):
    """A QA reward: the answer read from the completion, scored by ``metric(prediction,
    golds)`` (the subclass's; 0.0 when no answer can be read)."""

    cheap = True  # string normalisation and compares: run on the event loop
    metric: Callable[[str, list[str]], float]

    def __init__(self, answer_tag: str | None = None, answers_key: str = "answers",
                 answer_key: str = "answer"):
        if answer_tag is not None and not re.fullmatch(r"[A-Za-z_][\w-]*", answer_tag):
            raise ValueError(f"answer_tag: a tag name like 'answer', got {answer_tag!r}")
        self.answer_tag, self.answers_key, self.answer_key = answer_tag, answers_key, answer_key

    def __call__(self, completion: str, metadata: dict) -> float:
        golds = gold_answers(metadata, self.answers_key, self.answer_key)
        prediction = extract_answer(completion, self.answer_tag)
        if prediction is None:
            return 0.0
        return float(self.metric(prediction, golds))


class QAExactMatchReward(_QAReward):
    """1.0 when the answer matches a gold answer after normalisation (see the module docstring).

    Args:
        answer_tag: read the answer from the last ``<answer_tag>...</answer_tag>`` (None: the
            whole final text).
        answers_key: the metadata key of the gold answer list
            (:class:`~astralight.tasks.qa.QASource` writes ``answers``).
        answer_key: the single-answer key used when ``answers_key`` is absent.
    """

    metric = staticmethod(exact_match)


class QAF1Reward(_QAReward):
    """Token F1 of the answer against the best gold answer, in [0, 1] (arguments as
    :class:`QAExactMatchReward`)."""

    metric = staticmethod(f1_score)
