"""The toy policy's supervised warm start: a loadable, deterministic model folder, and its helpers."""

from __future__ import annotations

import json

import pytest
import torch

from astralight.tasks.arithmetic import ArithmeticSource
from astralight.tasks.warmstart import (
    EOS_ID, build_toy_policy, heldout_accuracy, main, sample_completions, train_warmstart,
)
from astralight.trainer.tinymodel import TinyModelSpec, build_model, build_tokenizer

SMALL = {"min_operand": 0, "max_operand": 9, "ops": "+"}


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_folder_loads_with_transformers_and_is_deterministic(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(source_kwargs=SMALL, sft_steps=3, batch_size=8, lr=1e-2, progress=False)
    a = build_toy_policy(tmp_path / "a", seed=0, **kw)
    b = build_toy_policy(tmp_path / "b", seed=0, **kw)
    c = build_toy_policy(tmp_path / "c", seed=1, **kw)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "same seed must give identical weights"
    assert any(not torch.equal(wa[k], wc[k]) for k in wa), "another seed must change the batches"

    model = AutoModelForCausalLM.from_pretrained(a)
    tok = AutoTokenizer.from_pretrained(a)
    assert tok("12+3=", add_special_tokens=False)["input_ids"] == build_tokenizer()("12+3=")["input_ids"]
    assert model.config.eos_token_id == EOS_ID
    assert model(input_ids=torch.tensor([tok("1+2=")["input_ids"]])).logits.shape[-1] == 96
    meta = json.loads((a / "warmstart.json").read_text())
    assert (meta["sft_steps"], meta["seed"], meta["source_kwargs"]) == (3, 0, SMALL)
    assert not list(tmp_path.glob(".*tmp*")), "the temporary build folder must be renamed away"


def test_num_threads_is_restored(tmp_path):
    before = torch.get_num_threads()
    kw = dict(source_kwargs=SMALL, sft_steps=2, batch_size=4, progress=False)
    build_toy_policy(tmp_path / "one", num_threads=1, **kw)
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads"):
        build_toy_policy(tmp_path / "zero", num_threads=0, **kw)


def test_training_lowers_the_loss():
    losses = []
    train_warmstart(TinyModelSpec(), SMALL, sft_steps=40, lr=1e-2, batch_size=32, seed=0,
                    progress=lambda step, loss: losses.append(loss), label_smoothing=0.0)
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_spec_may_come_from_yaml_as_a_dict(tmp_path):
    out = build_toy_policy(tmp_path / "m", spec={"num_hidden_layers": 1, "seed": 3},
                           source_kwargs=SMALL, sft_steps=1, batch_size=4, progress=False)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    with pytest.raises(ValueError, match="spec: unknown TinyModelSpec fields"):
        build_toy_policy(tmp_path / "n", spec={"layers": 1}, sft_steps=1, progress=False)


@pytest.mark.parametrize("kwargs, field", [
    ({"source_kwargs": {"split": "eval"}}, "source_kwargs"),
    ({"source_kwargs": {"seed": 3}}, "source_kwargs"),
    ({"lr": 0.0}, "lr"),
    ({"batch_size": 0}, "batch_size"),
    ({"sft_steps": -1}, "sft_steps"),
    ({"label_smoothing": 1.0}, "label_smoothing"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        train_warmstart(**{"sft_steps": 1, "batch_size": 2, **kwargs})


def test_refuses_to_overwrite_a_non_empty_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="out_dir"):
        build_toy_policy(tmp_path / "m", sft_steps=1, progress=False)
    assert (tmp_path / "m" / "keep.txt").exists()


def test_left_padded_batch_sampling_matches_one_prompt_at_a_time():
    """Greedy decoding of a mixed-length batch must equal decoding each prompt alone."""
    model, tok = build_model(TinyModelSpec(seed=5)).eval(), build_tokenizer()
    prompts = ["1+2=", "33+44=", "7+10="]
    batch, batch_tokens = sample_completions(model, tok, prompts, max_new_tokens=5, temperature=0)
    for prompt, text, tokens in zip(prompts, batch, batch_tokens):
        alone, alone_tokens = sample_completions(model, tok, [prompt], max_new_tokens=5, temperature=0)
        assert (alone[0], alone_tokens[0]) == (text, tokens)
        assert 1 <= len(tokens) <= 5
        assert EOS_ID not in tokens[:-1]


class ScriptedModel(torch.nn.Module):
    """Unit-test fake: emits ``script[t]`` as the t-th new token (of any prompt), then <eos>."""

    def __init__(self, script: list[int], prompt_len: int):
        super().__init__()
        self.script, self.prompt_len = script, prompt_len

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        t = input_ids.shape[1] - self.prompt_len
        logits = torch.full((*input_ids.shape, 96), -1e9)
        logits[:, -1, self.script[t] if t < len(self.script) else EOS_ID] = 0.0
        return type("Out", (), {"logits": logits})()


def test_sampling_stops_at_eos_and_drops_it_from_the_text():
    tok = build_tokenizer()
    digits = tok("42", add_special_tokens=False)["input_ids"]
    model = ScriptedModel(digits, prompt_len=4)
    texts, tokens = sample_completions(model, tok, ["1+1=", "2+2="], max_new_tokens=6)
    assert texts == ["42", "42"] and tokens == [digits + [EOS_ID]] * 2
    texts, tokens = sample_completions(model, tok, ["1+1="], max_new_tokens=1)
    assert texts == ["4"] and tokens == [digits[:1]]  # cut by max_new_tokens: no <eos>


def test_sampling_is_seeded():
    model, tok = build_model(TinyModelSpec(seed=1)).eval(), build_tokenizer()
    draw = lambda s: sample_completions(model, tok, ["1+1="] * 8, generator=torch.Generator().manual_seed(s))
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)  # 8 samples of 4 tokens from a near-uniform model: collisions ~impossible


def test_heldout_accuracy_is_a_fraction_of_the_eval_split():
    model, tok = build_model(TinyModelSpec()).eval(), build_tokenizer()
    acc = heldout_accuracy(model, tok, SMALL, k=2)
    assert 0.0 <= acc <= 0.1  # an untrained model is (almost) never right


def test_eval_source_length_counts_distinct_prompts_before_any_get():
    src = ArithmeticSource(split="eval", max_operand=9, eval_size=200)
    n = len(src)  # 100 pairs, ~10% held out: fewer than eval_size
    assert 0 < n < 200
    assert len({src.get(i).prompt_id for i in range(n)}) == n
    with pytest.raises(IndexError):
        src.get(n)
    assert ArithmeticSource().max_operand == 49


def test_cli_builds_the_folder_and_reports_json(tmp_path, capsys):
    assert main([str(tmp_path / "cli"), "--sft-steps", "2", "--batch-size", "4",
                 "--max-operand", "9", "--eval"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["out_dir"] == str(tmp_path / "cli")
    assert 0.0 <= result["heldout_avg@4_t1"] <= 1.0 and 0.0 <= result["heldout_greedy"] <= 1.0
    assert (tmp_path / "cli" / "model.safetensors").exists()
