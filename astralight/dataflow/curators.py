"""Prompt curators: the pre-rollout hook that decides which prompts become tasks.

A rollout is the expensive part of RL for LLMs, so skipping a prompt whose group will teach the
trainer nothing (every sample right, or every sample wrong: zero reward variance, hence zero
group-normalised advantage) saves generation time. The service asks every curator in order
(``should_submit``, short-circuit), tells each one every outcome (``update``) and every new
policy version (``on_version``). A generic safety valve in the service forces a prompt after
``curator_max_skips`` consecutive rejections; the curators here are also sane on their own.
"""

from __future__ import annotations

from astralight.dataflow.plugins import DataPlugin, PromptOutcome, check_range
from astralight.tasks.base import Prompt

_INF = float("inf")


def _check_model_id(model_id: str | None) -> str | None:
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ValueError(f"model_id: must be null (every policy) or a non-empty policy name, "
                         f"got {model_id!r}")
    return model_id


class PromptCurator(DataPlugin):
    """Base of prompt curators. The default accepts everything and learns nothing."""

    def should_submit(self, prompt: Prompt, version: int) -> bool:
        return True

    def update(self, outcome: PromptOutcome) -> None:
        pass

    def on_version(self, version: int) -> None:
        pass


class AcceptAll(PromptCurator):
    """Submit every prompt (vanilla RL)."""


class FilterSolved(PromptCurator):
    """Skip prompts the policy already solves.

    Keeps an EWMA of each prompt's solve rate (the fraction of its group's rewards
    ``>= correct_threshold``) and skips a prompt whose EWMA is ``>= threshold``. Because the
    policy can forget, a skipped prompt is still submitted with probability ``revisit_prob``
    (drawn from ``self.rng``), which refreshes its EWMA.
    """

    def __init__(self, threshold: float = 0.9, ewma_alpha: float = 0.5,
                 correct_threshold: float = 0.5, revisit_prob: float = 0.0,
                 model_id: str | None = None):
        super().__init__()
        self.threshold = check_range("threshold", threshold, 0.0, 1.0, lo_open=True)
        self.ewma_alpha = check_range("ewma_alpha", ewma_alpha, 0.0, 1.0, lo_open=True)
        self.correct_threshold = check_range("correct_threshold", correct_threshold, -_INF, _INF)
        self.revisit_prob = check_range("revisit_prob", revisit_prob, 0.0, 1.0)
        self.model_id = _check_model_id(model_id)
        self.ewma: dict[str, float] = {}

    def should_submit(self, prompt: Prompt, version: int) -> bool:
        rate = self.ewma.get(prompt.prompt_id)
        if rate is None or rate < self.threshold:
            return True
        return self.revisit_prob > 0 and self.rng.random() < self.revisit_prob

    def update(self, outcome: PromptOutcome) -> None:
        rewards = [r for g in outcome.groups(self.model_id) for r in g]
        if not rewards:
            return  # the outcome has nothing for our policy
        rate = sum(r >= self.correct_threshold for r in rewards) / len(rewards)
        old = self.ewma.get(outcome.prompt_id)
        self.ewma[outcome.prompt_id] = rate if old is None else (
            self.ewma_alpha * rate + (1.0 - self.ewma_alpha) * old)

    def state_dict(self) -> dict:
        return {"ewma": dict(self.ewma)}

    def load_state_dict(self, state: dict) -> None:
        self.ewma = {str(k): float(v) for k, v in state.get("ewma", {}).items()}

    def metrics(self) -> dict[str, float]:
        return {"tracked_prompts": float(len(self.ewma)),
                "solved_prompts": float(sum(v >= self.threshold for v in self.ewma.values()))}


class GRESO(PromptCurator):
    """GRESO: pre-rollout filtering of prompts predicted to be zero-variance.

    "Act Only When It Pays" (Zheng et al., arXiv 2506.02177) observes that prompts are
    temporally consistent: a prompt whose group had zero reward variance in recent epochs (all
    correct: "easy", all wrong: "hard") very likely has zero variance again, so rolling it out
    again buys no gradient. Per prompt we keep ``streak`` = the number of consecutive most recent
    zero-variance outcomes and ``kind`` of the latest one, and submit the prompt with probability
    ``max(p_kind ** streak, floor_kind)``, so a longer streak means a likelier skip but never a
    certain one (the floors go beyond the paper, so a prompt is never abandoned and a stream of
    all zero-variance prompts still moves without the service's safety valve).

    The exploration probabilities adapt, as in the paper's Algorithm 1: after every policy
    version, if the window's share of easy (hard) zero-variance outcomes exceeds the target
    ``alpha_easy`` (``alpha_hard``), too many useless prompts got through, so ``p_easy``
    (``p_hard``) drops by ``delta_p``; otherwise it rises by ``delta_p``; each is clamped to
    ``[floor_kind, 1]``. The defaults are the paper's settings (targets of 1/12 and 1/6).

    ``model_id=None`` judges a prompt by every policy's group (zero-variance only if every group
    is; kind from the mean over all rewards); a name judges it by that policy's group only and
    ignores outcomes without it.
    """

    def __init__(self, p_easy: float = 0.5, p_hard: float = 0.5, alpha_easy: float = 0.083,
                 alpha_hard: float = 0.167, delta_p: float = 0.01, floor_easy: float = 0.05,
                 floor_hard: float = 0.30, correct_threshold: float = 0.5,
                 zero_variance_eps: float = 1e-6, model_id: str | None = None):
        super().__init__()
        self.floor = {"easy": check_range("floor_easy", floor_easy, 0.0, 1.0),
                      "hard": check_range("floor_hard", floor_hard, 0.0, 1.0)}
        self.p = {"easy": check_range("p_easy", p_easy, 0.0, 1.0, lo_open=True),
                  "hard": check_range("p_hard", p_hard, 0.0, 1.0, lo_open=True)}
        for kind in ("easy", "hard"):
            if self.p[kind] < self.floor[kind]:
                raise ValueError(f"p_{kind}: must be >= floor_{kind} ({self.floor[kind]}) and "
                                 f"<= 1.0, got {self.p[kind]}")
        self.alpha = {"easy": check_range("alpha_easy", alpha_easy, 0.0, 1.0),
                      "hard": check_range("alpha_hard", alpha_hard, 0.0, 1.0)}
        self.delta_p = check_range("delta_p", delta_p, 0.0, 1.0)
        self.correct_threshold = check_range("correct_threshold", correct_threshold, -_INF, _INF)
        self.zero_variance_eps = check_range("zero_variance_eps", zero_variance_eps, 0.0, _INF)
        self.model_id = _check_model_id(model_id)
        # prompt_id -> [streak > 0, kind]. A prompt whose streak is 0 behaves exactly like one
        # never seen, so it is dropped: the state stays as small as the set of live streaks.
        self.streaks: dict[str, list] = {}
        self.window = {"outcomes": 0, "easy": 0, "hard": 0}  # since the last on_version
        self.last_ratio = {"easy": 0.0, "hard": 0.0}

    # -- decisions --------------------------------------------------------------------------
    def submit_prob(self, prompt_id: str) -> float:
        """Probability that ``should_submit`` says yes for this prompt right now."""
        entry = self.streaks.get(prompt_id)
        if entry is None:
            return 1.0
        streak, kind = entry
        return max(self.p[kind] ** streak, self.floor[kind])

    def should_submit(self, prompt: Prompt, version: int) -> bool:
        if prompt.prompt_id not in self.streaks:
            return True  # no streak: no evidence against it, and no random draw consumed
        return bool(self.rng.random() < self.submit_prob(prompt.prompt_id))

    # -- learning ---------------------------------------------------------------------------
    def update(self, outcome: PromptOutcome) -> None:
        groups = outcome.groups(self.model_id)
        if not groups:
            return
        zero_var = all(max(g) - min(g) <= self.zero_variance_eps for g in groups)
        self.window["outcomes"] += 1
        if not zero_var:
            self.streaks.pop(outcome.prompt_id, None)
            return
        rewards = [r for g in groups for r in g]
        kind = "easy" if sum(rewards) / len(rewards) >= self.correct_threshold else "hard"
        self.window[kind] += 1
        streak = self.streaks.get(outcome.prompt_id, [0, kind])[0]
        self.streaks[outcome.prompt_id] = [streak + 1, kind]

    def on_version(self, version: int) -> None:
        n = self.window["outcomes"]
        if n == 0:
            return  # no evidence since the last version: leave p where it is
        for kind in ("easy", "hard"):
            ratio = self.window[kind] / n
            self.last_ratio[kind] = ratio
            step = -self.delta_p if ratio > self.alpha[kind] else self.delta_p
            self.p[kind] = min(1.0, max(self.floor[kind], self.p[kind] + step))
        self.window = {"outcomes": 0, "easy": 0, "hard": 0}

    # -- persistence and metrics ------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"p_easy": self.p["easy"], "p_hard": self.p["hard"],
                "streaks": {k: list(v) for k, v in self.streaks.items()},
                "window": dict(self.window),
                "last_ratio": dict(self.last_ratio)}

    def load_state_dict(self, state: dict) -> None:
        self.p = {"easy": float(state["p_easy"]), "hard": float(state["p_hard"])}
        self.streaks = {str(k): [int(v[0]), str(v[1])] for k, v in state["streaks"].items()}
        self.window = {k: int(state["window"][k]) for k in ("outcomes", "easy", "hard")}
        self.last_ratio = {k: float(state["last_ratio"][k]) for k in ("easy", "hard")}

    def metrics(self) -> dict[str, float]:
        kinds = [kind for _, kind in self.streaks.values()]
        return {"p_easy": self.p["easy"], "p_hard": self.p["hard"],
                "tracked_prompts": float(len(self.streaks)),
                "easy_streaks": float(kinds.count("easy")),
                "hard_streaks": float(kinds.count("hard")),
                "easy_zero_variance_ratio": self.last_ratio["easy"],
                "hard_zero_variance_ratio": self.last_ratio["hard"]}
