"""Engine fakes shared by the workflow unit tests, and :func:`run_tasks`.

Every fake goes through the real request path of :class:`astralight.raas.engine.BatchedEngine`
(``submit``, the worker thread that batches whatever is waiting, the version stamp) and only
implements ``_generate``, so a workflow under test meets the engine contract it meets in the RaaS:
requests arrive one at a time or in batches, in submission order, and seeded specs give request
``i`` of a many-request call the seed ``seed + i``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from astralight.engine import Completion, SamplingSpec

from astralight.raas.engine import BatchedEngine


def in_episode(endpoint: Any, engine: Any, fn: Callable[[str, str], Any],
               settings: Any = None) -> tuple[Any, list]:
    """``fn(base_url, api_key)`` on a thread while an episode of ``endpoint`` (an
    :class:`~astralight.raas.openai_endpoint.OpenAIEndpoint`) is open on ``engine``, with the
    process token; ``(fn's result, the episode's call records)``."""
    async def main():
        ep = endpoint.open_episode(engine, "policy", settings)
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                None, fn, endpoint.base_url(ep.id), endpoint.token)
        finally:
            records = endpoint.close_episode(ep.id)
        return out, records

    return asyncio.run(main())


def run_tasks(workflow: Any, tasks: list, engines: dict[str, Any]) -> dict[str, list]:
    """``{task_id: samples}``: every task run as its own episode, all concurrently in one event
    loop, as the RaaS runs the tasks it leases."""
    async def main():
        outs = await asyncio.gather(*(workflow.run(t, engines) for t in tasks))
        return {t.task_id: list(o) for t, o in zip(tasks, outs)}

    return asyncio.run(main())


def _completion(tokenizer: Any, text: str, logprob: float, finish: str,
                version: int | None = None) -> Completion:
    """``text`` as a completion (EOS appended when it ends on ``"stop"``)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if finish == "stop":
        ids.append(tokenizer.eos_token_id)
    return Completion(ids, [logprob] * len(ids), finish, version=version)


class ScriptedEngine(BatchedEngine):
    """Returns fixed completions in order: request ``i`` (counted over the engine's life, in
    serving order) gets ``texts[i % len(texts)]``.

    Recorded: ``requests`` (how many were served), ``calls`` (``(batch size, spec)`` per batch),
    ``updates`` (``(tensor names, version)`` per weight update). ``delay_s``: each batch takes
    that long (a slow model, so tests can act while requests are in flight).
    """

    def __init__(self, tokenizer: Any, texts: list[str], version: int = 7, finish: str = "stop",
                 max_model_len: int = 128, logprob: float = -0.5, delay_s: float = 0.0):
        self.tokenizer, self.texts, self.version, self.finish = tokenizer, list(texts), version, finish
        self.max_model_len, self.logprob, self.delay_s = max_model_len, logprob, delay_s
        self.requests = 0
        self.calls: list[tuple[int, SamplingSpec]] = []
        self.updates: list[tuple[list[str], int]] = []

    def _generate(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        """One batch: the next texts of the list, one per prompt."""
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        self.calls.append((len(prompts), params))
        out = []
        for _ in prompts:
            text = self.texts[self.requests % len(self.texts)]
            self.requests += 1
            out.append(_completion(self.tokenizer, text, self.logprob, self.finish))
        return out

    def update_weights(self, named_tensors, version, **kw):
        """Between two batches, as a real engine: record it, move the version (no weights)."""
        def load():
            self.updates.append((sorted(named_tensors), int(version)))
            self.version = int(version)

        self.call(load)


class TurnScriptEngine(BatchedEngine):
    """Multi-turn episodes: a prompt's action comes from ``script[first_observation][turn]``,
    where the first observation is the context up to its first ``=`` and ``turn`` the number of
    ``?`` (observations) in the context so far. Turn ``t`` is sampled by version
    ``version + t`` (as if weights were refreshed between turns), the same however requests are
    batched.

    Recorded: ``calls`` (batch size per batch), ``temperatures`` (per request).
    """

    def __init__(self, tokenizer: Any, script: dict[str, list[str]], version: int = 3,
                 max_model_len: int = 64, logprob: float = -0.25):
        self.tokenizer, self.script, self.version = tokenizer, script, version
        self.max_model_len, self.logprob = max_model_len, logprob
        self.calls: list[int] = []
        self.temperatures: list[float] = []

    def _generate(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        """One batch: each prompt's scripted action for its turn."""
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            text = self.tokenizer.decode(list(p))
            first = text.split("?")[0]
            first = first[: first.index("=") + 1] if "=" in first else first
            turn = text.count("?")
            self.temperatures.append(params.temperature)
            out.append(_completion(self.tokenizer, self.script[first][turn], self.logprob, "stop",
                                   version=self.version + turn))
        return out


Respond = Callable[[str, int], str]


def script(answers: dict[str, list[str]]) -> Respond:
    """A responder from ``{prompt_text: [texts]}``: the k-th request for a prompt gets
    ``texts[k % len(texts)]``; a prompt not in the script is a KeyError naming it."""
    def respond(prompt: str, k: int) -> str:
        if prompt not in answers:
            raise KeyError(f"scripted engine: no answer for prompt {prompt!r}")
        texts = answers[prompt]
        return texts[k % len(texts)]

    return respond


class PromptScriptEngine(BatchedEngine):
    """Answers each request by its prompt text: ``respond(prompt_text, k)`` plus EOS.

    ``k`` counts the earlier requests with the same prompt text: requests are served in
    submission order, so within one episode ``k`` is deterministic. ``respond`` may also be a
    ``{prompt_text: [texts]}`` dict (:func:`script`). Every generated token gets log-prob
    ``logprob``; the engine stamps its ``version`` on every token.

    Recorded for assertions:
        requests: ``(prompt_text, spec)`` of every request, in the order served;
        log: a list (shared between engines if passed in) that gets ``(name, prompt_text)`` at
            every ``submit``, i.e. in the order the workflow submitted across engines;
        peak: the most ``generate`` calls in flight at once.
    """

    def __init__(self, respond: Respond | dict[str, list[str]], tokenizer: Any, version: int = 0,
                 max_model_len: int | None = None, logprob: float = -0.5, name: str = "",
                 log: list | None = None):
        self.respond = script(respond) if isinstance(respond, dict) else respond
        self.tokenizer, self.version, self.max_model_len = tokenizer, version, max_model_len
        self.logprob, self.name = logprob, name
        self.log = [] if log is None else log
        self.requests: list[tuple[str, SamplingSpec]] = []
        self.served: dict[str, int] = {}
        self.active = self.peak = 0
        self._lock = threading.Lock()

    def submit(self, prompt_token_ids, params):
        """Record the submission, then queue it as every BatchedEngine does."""
        with self._lock:
            self.log.append((self.name, self.tokenizer.decode(list(prompt_token_ids))))
        return super().submit(prompt_token_ids, params)

    async def generate(self, prompt_token_ids, params):
        """The contract's ``generate``, counting how many calls are in flight at once."""
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await super().generate(prompt_token_ids, params)
        finally:
            self.active -= 1

    def _generate(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        """One batch from the worker thread: each prompt answered from the script."""
        out = []
        for p in prompts:
            text = self.tokenizer.decode(list(p))
            k = self.served.get(text, 0)
            self.served[text] = k + 1
            self.requests.append((text, params))
            out.append(_completion(self.tokenizer, self.respond(text, k), self.logprob, "stop"))
        return out

    def update_weights(self, named_tensors, version):
        """Only the version changes (a scripted engine has no weights)."""
        self.version = version

    def prompts(self) -> list[str]:
        """The prompt texts served so far, in order."""
        return [text for text, _ in self.requests]


class ConstrainedScriptEngine(PromptScriptEngine):
    """A :class:`PromptScriptEngine` that declares ``constrained_decoding`` (as vLLM does), so the
    OpenAI endpoint hands it constrained specs: each one's ``constraint`` is recorded in
    ``requests`` with the spec, and the scripted text is returned as it is (a test scripts text
    that satisfies the constraint; the fake checks nothing). A ``refuse`` message makes it
    answer every constrained request with :class:`~astralight.engine.ConstraintError` (a schema
    the engine's grammar backend rejects)."""

    constrained_decoding = True

    def __init__(self, *args: Any, refuse: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.refuse = refuse

    def submit(self, prompt_token_ids, params):
        """Refuse a constrained spec when told to, as vLLM refuses a schema it cannot compile."""
        if self.refuse is not None and params.constraint is not None:
            from astralight.engine import ConstraintError

            raise ConstraintError(self.refuse)
        return super().submit(prompt_token_ids, params)


#: the scripted calculator policy's tool call (the add tool on the sum 123+456)
CALCULATOR_CALL = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>'


def calculator(prompt: str, k: int) -> str:
    """A :class:`PromptScriptEngine` script of the calculator agent's policy: call add first,
    copy its result once it is in the context."""
    if "<tool_response>\n579\n" in prompt:
        return "579"
    return "Let me add." + CALCULATOR_CALL if "123+456=" in prompt else "0"
