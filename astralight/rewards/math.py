"""Math reward: the last ``\\boxed{...}`` answer of a completion checked against the ground truth.

Pipeline of one call, cheapest first:

1. **Extraction**: the argument of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), with
   nested braces; optionally, when there is no box, the last ``Answer: ...`` line (the format
   DAPO-Math-17k's own prompts ask for), or the last number of the text (``last_number``: the
   GSM8K convention, for small chat models that never box; ``1,234`` and ``-5`` are numbers).
   No answer -> ``no_answer_reward`` (a format reward).
2. **Fast path** (microseconds): the answer and the truth are compared as normalised strings
   (spacing, ``\\left``/``\\right``, ``\\dfrac``, ``$``, ``\\text{}`` wrappers, a final period) and,
   when both are plain numbers, numerically (``0.5 == .50``, ``1,000 == 1000``). Equal -> correct.
   Two different integers -> wrong at once (most RL answers are integers: DAPO's and AIME's all
   are). Anything else goes to step 3.
3. **math-verify** (``parse`` + ``verify``: fractions vs decimals, ``\\frac`` vs ``/``, sets,
   intervals, units text, equations...), typically 1-100 ms, but it can hang on pathological
   input. math-verify's own timeout uses ``signal.alarm``, which only works in a main thread,
   and the RaaS scores completions from worker threads. So by default (``isolation="process"``)
   the check runs in a :class:`~astralight.rewards.subprocess_pool.SubprocessPool` worker: in
   the worker's main thread math-verify's own (whole-second, per step) timeout applies with half
   the budget, and the pool kills the worker if the whole check does not answer within
   ``timeout_s`` (several slow steps, or a hang in C code that a signal cannot interrupt). A
   timeout scores ``timeout_reward``; nothing blocks the caller longer than ``timeout_s`` (plus
   a worker start, ~0.2-0.5 s, the first time, and the wait for a free worker).
   ``isolation="inline"`` runs math-verify in the calling thread (no hard timeout off the main
   thread): for scripts and benchmarks only.

Measured here (2 shared CPU cores): extraction + fast path ~14 us a call; math-verify ~0.2 ms
median warm (1-200 ms for a new expression, e.g. sets, polynomials); a pool round trip adds
~30 us (median 0.4 ms a check through the pool); a worker starts in ~0.2-0.5 s; a hung check
returns at ``timeout_s`` (1.0 s -> 1.01 s) and the next call restarts a worker in ~0.3 s.

Rewards are plain classes named by import path in YAML::

    reward:
      class_path: astralight.rewards.math.MathVerifyReward
      init_args: {answer_key: answer, timeout_s: 5.0, workers: 4}

Needs the ``math`` extra (``pip install astralight[math]``, i.e. ``math-verify==0.9.0``) unless
every answer is settled by the fast path.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from astralight.rewards.base import Reward
from astralight.rewards.subprocess_pool import PoolError, PoolTimeout, SubprocessPool

log = logging.getLogger(__name__)

__all__ = ["MathVerifyReward", "last_boxed", "last_answer_line", "last_number", "normalize_answer",
           "fast_compare", "math_verify_equal"]

_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_LINE = re.compile(r"(?im)^\s*\**answer\**\s*[:：]\s*\**\s*(.+?)\s*$")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the ``{...}`` group opening at ``text[start]`` and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        # an escaped brace \{ (a set in LaTeX) does not open or close a group
        if c == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif c == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Argument of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed),
    or of ``\\boxed 5`` (one token); None when there is none (an unclosed final box, from a
    generation cut at its token limit, does not count)."""
    found = None
    for m in _BOX.finditer(text):
        j = m.end()
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            group = _braced(text, j)
            if group is not None:
                found = group[0]
        elif m.end() < len(text) and text[m.end()] == " ":
            token = re.match(r"[^\s$]+", text[j:])
            if token:
                found = token.group(0)
    return None if found is None else found.strip()


def last_answer_line(text: str) -> str | None:
    """The value of the last ``Answer: ...`` line (DAPO-Math-17k's prompt format), or None."""
    matches = _ANSWER_LINE.findall(text)
    if not matches:
        return None
    value = matches[-1].strip().rstrip(".").strip().strip("$").strip().rstrip(".").strip()
    return value or None


_ANY_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (thousands commas dropped), or None."""
    found = _ANY_NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def normalize_answer(s: str) -> str:
    """A canonical spelling for string comparison; only rewrites that never change the value."""
    s = s.strip()
    inner = last_boxed(s) if "\\boxed" in s or "\\fbox" in s else None
    if inner is not None:
        s = inner
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for space in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "$"):
        s = s.replace(space, "")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def _plain_number(s: str) -> Fraction | None:
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Fraction(Decimal(s))
    except (InvalidOperation, ValueError):
        return None


def fast_compare(gold: str, pred: str) -> bool | None:
    """True/False when cheap rules settle it, None when math-verify must decide."""
    g, p = normalize_answer(gold), normalize_answer(pred)
    if g == p and g:
        return True
    gn, pn = _plain_number(g), _plain_number(p)
    if gn is not None and pn is not None:
        if gn == pn:
            return True
        if gn.denominator == 1 and pn.denominator == 1 and "." not in g + p:
            return False  # two different integers
    return None


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None):
    from math_verify import parse

    parsed = parse(f"${gold}$", parsing_timeout=timeout)
    return parsed or parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)


def math_verify_equal(gold: str, pred: str, timeout: int | None = None) -> bool:
    """math-verify's verdict on ``pred`` (an extracted answer) against ``gold``.

    ``timeout`` (whole seconds) is math-verify's own signal-based limit on each parse/verify: it
    may only be set in a main thread (as in a pool worker); None disables it.
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("MathVerifyReward needs math-verify: pip install 'astralight[math]' "
                          "(math-verify==0.9.0)") from None
    if timeout is not None and threading.current_thread() is not threading.main_thread():
        timeout = None  # signal.alarm is main-thread only; the caller bounds the time
    gold_parsed = _parse_gold(gold, timeout)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


#: how an answer is found in a completion (MathVerifyReward's ``answer_format``)
ANSWER_FORMATS = ("boxed", "boxed_or_answer_line", "boxed_or_last_number")


class MathVerifyReward(Reward):
    """``reward(completion, metadata)``: ``correct_reward`` when the last boxed answer of the
    completion equals ``metadata[answer_key]`` (see the module docstring), else ``wrong_reward``.

    Args:
        answer_key: metadata field holding the ground truth (a string, or a number).
        correct_reward / wrong_reward: the two outcomes.
        no_answer_reward: score of a completion with no extractable answer (a format reward).
        timeout_reward: score when math-verify runs past ``timeout_s`` (or its worker fails).
        answer_format: ``boxed`` (last ``\\boxed{}``), ``boxed_or_answer_line`` (else the last
            ``Answer: ...`` line, for DAPO-style prompts) or ``boxed_or_last_number`` (else the
            last number of the text, for chat models that do not box).
        timeout_s: hard limit on one math-verify check.
        workers: worker processes (``isolation="process"``): concurrent checks.
        isolation: ``process`` (default; killable workers) or ``inline`` (calling thread; no hard
            timeout off the main thread).
        fast_path: settle string-equal / plain-number answers without math-verify.
        max_answer_chars: longer extracted answers score ``wrong_reward`` unchecked (a guard
            against pathological input).
        verifier: import path of ``f(gold, pred, timeout) -> bool`` (tests swap in stubs).
    """

    def __init__(self, answer_key: str = "answer", correct_reward: float = 1.0,
                 wrong_reward: float = 0.0, no_answer_reward: float = 0.0,
                 timeout_reward: float = 0.0, answer_format: str = "boxed",
                 timeout_s: float = 5.0, workers: int = 2, isolation: str = "process",
                 fast_path: bool = True, max_answer_chars: int = 1000,
                 verifier: str = "astralight.rewards.math.math_verify_equal"):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format: one of {', '.join(ANSWER_FORMATS)}, "
                             f"got {answer_format!r}")
        if isolation not in ("process", "inline"):
            raise ValueError(f"isolation: 'process' or 'inline', got {isolation!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        self.answer_key = answer_key
        self.correct_reward, self.wrong_reward = float(correct_reward), float(wrong_reward)
        self.no_answer_reward, self.timeout_reward = float(no_answer_reward), float(timeout_reward)
        self.answer_format = answer_format
        self.timeout_s, self.workers, self.isolation = float(timeout_s), workers, isolation
        self.fast_path, self.max_answer_chars = fast_path, max_answer_chars
        self.verifier = verifier
        self._pool: SubprocessPool | None = None
        self._inline_fn = None
        self._lock = threading.Lock()
        #: outcome counters (read them for logging): no_answer, fast, verified, timeouts, errors
        self.stats = {"calls": 0, "no_answer": 0, "too_long": 0, "fast": 0, "verified": 0,
                      "correct": 0, "timeouts": 0, "errors": 0}

    # ------------------------------------------------------------------ public

    def extract(self, completion: str) -> str | None:
        answer = last_boxed(completion)
        if answer is None and self.answer_format == "boxed_or_answer_line":
            answer = last_answer_line(completion)
        elif answer is None and self.answer_format == "boxed_or_last_number":
            answer = last_number(completion)
        return answer or None

    def __call__(self, completion: str, metadata: dict) -> float:
        if self.answer_key not in metadata:
            raise KeyError(f"metadata.{self.answer_key}: missing; the task must carry its "
                           f"ground truth (got fields {sorted(metadata)})")
        gold = _gold_text(metadata[self.answer_key])
        self._count("calls")
        pred = self.extract(completion)
        if pred is None:
            self._count("no_answer")
            return self.no_answer_reward
        if len(pred) > self.max_answer_chars:
            self._count("too_long")
            return self.wrong_reward
        verdict = fast_compare(gold, pred) if self.fast_path else None
        if verdict is not None:
            self._count("fast")
        else:
            verdict = self._verify(gold, pred)
            if verdict is None:
                return self.timeout_reward
            self._count("verified")
        if verdict:
            self._count("correct")
        return self.correct_reward if verdict else self.wrong_reward

    def close(self) -> None:
        """Stop the worker processes (they also stop with this process)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    # ------------------------------------------------------------------ internals

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _verify(self, gold: str, pred: str) -> bool | None:
        """The verifier's verdict, or None on timeout / failure (counted and logged)."""
        # math-verify's own limit applies to each of its steps (2 parses + 1 verify): half the
        # budget lets one runaway step abort cleanly and keep its worker; the pool's hard limit
        # (kill) bounds the whole call
        inner = max(1, int(self.timeout_s // 2))
        if self.isolation == "inline":
            if self._inline_fn is None:
                from astralight.rewards.subprocess_pool import _import_function
                self._inline_fn = _import_function(self.verifier)
            return bool(self._inline_fn(gold, pred, inner))
        try:
            return bool(self._get_pool().call(gold, pred, inner))
        except PoolTimeout:
            self._count("timeouts")
            log.warning("math-verify: no verdict within %.1f s (answer %.80r vs %.80r); "
                        "scored %s", self.timeout_s, pred, gold, self.timeout_reward)
        except PoolError as exc:
            self._count("errors")
            if "math-verify" in str(exc) or "ImportError" in str(exc):
                raise ImportError(str(exc)) from None
            log.warning("math-verify failed (%s); scored %s", exc, self.timeout_reward)
        return None

    def _get_pool(self) -> SubprocessPool:
        with self._lock:
            if self._pool is None:
                self._pool = SubprocessPool(self.verifier, workers=self.workers,
                                            timeout_s=self.timeout_s)
            return self._pool


def _gold_text(value) -> str:
    """Ground truth as text; an integral float (parquet often stores 27.0) as ``27``."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return _gold_text(value[0])
    return str(value)
