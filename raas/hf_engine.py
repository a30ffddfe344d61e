"""A small transformers engine: for unit tests, and for checks on machines without vLLM.

It implements the :class:`astralight.engine.Engine` contract over an ``AutoModelForCausalLM``,
so workflow tests run without vLLM. Sampling honours ``temperature``, ``top_p`` (the behaviour
log-probs are the nucleus's, renormalised) and ``seed``. Two paths:

- ``batch_size=1`` (the default): one request at a time, the whole sequence recomputed each
  token (no KV cache), float32 on CPU, each request seeded ``seed + i`` -- exact and
  reproducible per request, which is what the unit tests compare against;
- ``batch_size>1``: left-padded batches with a KV cache, on any device and dtype (e.g. bf16 on a
  GPU), seeded per batch. ``tests/gpu/check.py`` uses it where vLLM cannot be installed.

Neither is a serving engine: the service uses :class:`astralight.raas.vllm_engine.VLLMEngine`.
"""

from __future__ import annotations

from typing import Any

from astralight.engine import Completion, ConstraintError, SamplingSpec, clamp_max_tokens

from astralight.raas.engine import BatchedEngine


def sampling_logprobs(logits: Any, temperature: float, top_p: float = 1.0) -> Any:
    """Log-probs ``[..., V]`` of the distribution a token is sampled from: softmax at
    ``temperature`` and, with ``top_p < 1``, cut to the nucleus (the most probable tokens whose
    mass before each is below ``top_p``; the most probable is always kept) and renormalised.
    Tokens outside the nucleus get ``-inf``. These are the behaviour log-probs, as vLLM's
    ``logprobs_mode="processed_logprobs"`` reports them."""
    import torch

    lp = torch.log_softmax(logits / temperature, -1)
    if top_p >= 1.0:
        return lp
    sorted_lp, order = lp.sort(-1, descending=True)
    probs = sorted_lp.exp()
    outside = (probs.cumsum(-1) - probs) >= top_p  # mass of the more probable tokens
    drop = torch.zeros_like(outside).scatter(-1, order, outside)
    return torch.log_softmax(lp.masked_fill(drop, float("-inf")), -1)


class HFEngine(BatchedEngine):
    """Requests submitted at once with equal sampling are generated together (up to
    ``batch_size`` per forward pass); weight updates run between two such batches.

    Args: model_path (a model folder), seed (the sampler's generator), version of its weights,
    max_model_len, device (``"cpu"``, ``"cuda"``), dtype (``"float32"``, ``"bfloat16"``),
    batch_size (requests per forward pass; 1 = the exact per-request path).

    It cannot constrain decoding: a spec with a ``constraint`` (a JSON schema, a forced tool
    call) is refused with :class:`~astralight.engine.ConstraintError` when submitted."""

    #: no grammar-constrained sampling here (see SamplingSpec.constraint)
    constrained_decoding = False

    def __init__(self, model_path: str, seed: int = 0, version: int = 0,
                 max_model_len: int | None = None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 1):
        import time

        import torch
        from transformers import AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size: must be at least 1, got {batch_size}")
        if batch_size == 1 and (device != "cpu" or dtype != "float32"):
            raise ValueError("batch_size: the per-request path (batch_size=1) is float32 on CPU; "
                             "set batch_size > 1 for another device or dtype")
        t = time.perf_counter()
        self.device, self.dtype, self.batch_size = torch.device(device), getattr(torch, dtype), batch_size
        self.max_batch = max(batch_size, 64)  # requests per _generate call (split into batch_size)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        from astralight.trainer.hf_models import causal_lm_from_pretrained  # loads must not overlap

        self.model = causal_lm_from_pretrained(str(model_path), dtype=self.dtype).to(
            self.device).eval()
        self.max_model_len = max_model_len or getattr(self.model.config, "max_position_embeddings", None)
        #: the model's vocabulary (embedding rows), registered with the dataflow (engine_limits)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = version
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = {eos} if eos is not None else set()
        self.start_s = time.perf_counter() - t

    def submit(self, prompt_token_ids: list[int], params: SamplingSpec):
        if params.constraint is not None:
            raise ConstraintError(f"constraint: the transformers engine ({type(self).__name__}) "
                                  "cannot constrain decoding; serve the policy with vLLM")
        return super().submit(prompt_token_ids, params)

    def _generate(self, prompt_token_ids: list[list[int]], params: SamplingSpec) -> list[Completion]:
        import torch

        stops = self.eos_token_ids | set(params.stop_token_ids)
        if self.batch_size > 1:
            out: list[Completion] = []
            for start in range(0, len(prompt_token_ids), self.batch_size):
                out += self._generate_batch(prompt_token_ids[start:start + self.batch_size],
                                            params, stops, start)
            return out
        out = []
        for i, prompt in enumerate(prompt_token_ids):
            gen = self.generator
            if params.seed is not None:
                gen = torch.Generator().manual_seed(params.seed + i)
            ids = list(prompt)
            tokens, logprobs, reason = [], [], "length"
            for _ in range(clamp_max_tokens(len(ids), params.max_tokens, self.max_model_len)):
                with torch.no_grad():
                    logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                if params.temperature == 0:
                    lp = torch.log_softmax(logits, -1)
                    tok = int(torch.argmax(logits))
                else:
                    lp = sampling_logprobs(logits, params.temperature, params.top_p)
                    tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
                tokens.append(tok)
                logprobs.append(float(lp[tok]))
                ids.append(tok)
                if tok in stops:
                    reason = "stop"
                    break
            out.append(Completion(tokens, logprobs, reason))
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingSpec, stops: set[int],
                        offset: int) -> list[Completion]:
        """One left-padded batch with a KV cache; the sampler seeded ``seed + offset`` per batch."""
        import torch

        dev, n = self.device, len(prompts)
        budgets = [clamp_max_tokens(len(p), params.max_tokens, self.max_model_len) for p in prompts]
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((n, width), pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator(device=dev).manual_seed(params.seed + offset)
        stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=dev)
        budget = torch.tensor(budgets, device=dev)
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        tokens, logprobs = [], []
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
            next_pos = positions[:, -1:] + 1
            for step in range(max(budgets)):
                logits = out.logits[:, -1].float()
                if params.temperature == 0:
                    lp = torch.log_softmax(logits, -1)
                    tok = lp.argmax(-1)
                else:
                    lp = sampling_logprobs(logits, params.temperature, params.top_p)
                    tok = torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]
                tokens.append(tok)
                logprobs.append(lp.gather(1, tok[:, None])[:, 0])
                done |= torch.isin(tok, stop_ids) | (budget <= step + 1)
                if bool(done.all()):
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], 1)
                out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                                 past_key_values=out.past_key_values, use_cache=True)
                next_pos = next_pos + 1
        all_tokens = torch.stack(tokens, 1).cpu().tolist()
        all_logprobs = torch.stack(logprobs, 1).cpu().tolist()
        completions = []
        for i in range(n):
            row, reason = all_tokens[i][:budgets[i]], "length"
            for j, t in enumerate(row):
                if t in stops:
                    row, reason = row[:j + 1], "stop"
                    break
            completions.append(Completion(row, all_logprobs[i][:len(row)], reason))
        return completions

    def update_weights(self, named_tensors: dict[str, Any], version: int, partial: bool = False) -> None:
        """Load the given tensors (all, or with ``partial=True`` any subset) and set ``version``,
        between two batches (never in the middle of one)."""
        self.call(lambda: self._load(named_tensors, version))

    def _load(self, named_tensors: dict[str, Any], version: int) -> None:
        _, unexpected = self.model.load_state_dict(
            {k: v.to(self.dtype) for k, v in named_tensors.items()}, strict=False)
        if unexpected:
            raise KeyError(f"named_tensors: unknown tensors {sorted(unexpected)[:5]}")
        self.version = int(version)

    def weight_update_names(self, changed, all_names) -> list[str]:
        """Every parameter loads on its own here (no fused modules): just the changed ones."""
        changed = set(changed)
        return [n for n in all_names if n in changed]

    def held_weights(self, shapes=None) -> dict[str, Any]:
        """The weights this engine computes with, cast to bf16, under checkpoint names."""
        import torch

        sd = self.model.state_dict()
        names = list(sd) if shapes is None else [n for n in shapes if n in sd]
        return {n: sd[n].detach().to(torch.bfloat16).clone() for n in names}

    def close(self) -> None:
        super().close()
        self.model = None
