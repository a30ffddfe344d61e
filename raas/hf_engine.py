"""A small transformers engine, for unit tests only.

It implements the :class:`astralight.raas.engine.Engine` contract with a plain sampling loop over a
``AutoModelForCausalLM`` (no KV cache, float32), so workflow tests run without vLLM. It is far too
slow for real rollouts; the service uses :class:`astralight.raas.vllm_engine.VLLMEngine`.
"""

from __future__ import annotations

from typing import Any

from astralight.raas.engine import Completion, SamplingSpec, clamp_max_tokens


class HFEngine:
    """Args: model_path (a model folder), seed (the sampler's generator), version of its weights."""

    def __init__(self, model_path: str, seed: int = 0, version: int = 0,
                 max_model_len: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        self.max_model_len = max_model_len or getattr(self.model.config, "max_position_embeddings", None)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = version
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = {eos} if eos is not None else set()

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingSpec) -> list[Completion]:
        import torch

        if params.top_p != 1.0:
            raise NotImplementedError("top_p: HFEngine samples from the full distribution only")
        stops = self.eos_token_ids | set(params.stop_token_ids)
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
                    lp = torch.log_softmax(logits / params.temperature, -1)
                    tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
                tokens.append(tok)
                logprobs.append(float(lp[tok]))
                ids.append(tok)
                if tok in stops:
                    reason = "stop"
                    break
            out.append(Completion(tokens, logprobs, reason))
        return out

    def update_weights(self, named_tensors: dict[str, Any], version: int, partial: bool = False) -> None:
        """Load the given tensors (all, or with ``partial=True`` any subset) and set ``version``."""
        _, unexpected = self.model.load_state_dict(
            {k: v.float() for k, v in named_tensors.items()}, strict=False)
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
        self.model = None
