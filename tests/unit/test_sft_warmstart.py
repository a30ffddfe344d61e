"""The generic supervised warm start (astralight.tasks.sft_warmstart): prompt -> target pairs from
a JSONL file, on the tiny model or any Hugging Face causal LM folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from astralight.tasks.sft_warmstart import build_sft_policy, encode_pairs, read_pairs
from astralight.tasks.warmstart import sample_completions
from astralight.trainer.tinymodel import build_tiny_model_folder, build_tokenizer

PAIRS = [("ab=", "ba"), ("cd=", "dc"), ("xy=", "yx"), ("12=", "21")]


def jsonl(tmp_path: Path, rows: list, name: str = "pairs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def data(tmp_path: Path) -> Path:
    return jsonl(tmp_path, [{"prompt": p, "target": t} for p, t in PAIRS])


def test_the_tiny_model_learns_the_pairs_and_is_saved_as_a_model_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_sft_policy(tmp_path / "out", data(tmp_path), sft_steps=100, batch_size=8,
                           progress=False, num_threads=1)
    assert {"config.json", "model.safetensors", "tokenizer.json", "warmstart.json"} <= {
        p.name for p in out.iterdir()}
    assert json.loads((out / "warmstart.json").read_text())["examples"] == len(PAIRS)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    texts, tokens = sample_completions(model, tokenizer, [p for p, _ in PAIRS], max_new_tokens=4,
                                       temperature=0)
    assert texts == [t for _, t in PAIRS]
    assert all(toks[-1] == tokenizer.eos_token_id for toks in tokens)  # it learned to stop


def test_any_causal_lm_folder_can_be_the_start(tmp_path):
    """``model_path``: its own tokenizer and weights, fine-tuned and saved with save_pretrained."""
    from safetensors.torch import load_file

    base = build_tiny_model_folder(tmp_path / "base")
    out = build_sft_policy(tmp_path / "out", data(tmp_path), model_path=str(base), sft_steps=3,
                           batch_size=4, lr=1e-3, progress=False)
    before, after = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(before) == set(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # trained
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert build_sft_policy.vocab_size(model_path=str(base)) == 96


def test_the_loss_covers_the_target_and_eos_only():
    tokenizer = build_tokenizer()
    ids, attn, mask = encode_pairs(tokenizer, [("ab=", "ba"), ("1=", "23")])
    assert ids.shape == (2, 6)
    assert mask[0].tolist() == [0, 0, 0, 1, 1, 1] and mask[1].tolist() == [0, 0, 1, 1, 1, 0]
    assert ids[0, 5].item() == tokenizer.eos_token_id and attn[1].tolist() == [1, 1, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="example 1 is 6 tokens, more than the model's 4"):
        encode_pairs(tokenizer, [("ab=", "ba")], max_length=4)


def test_bad_data_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"line 2 needs string fields 'prompt' and 'target'"):
        read_pairs(jsonl(tmp_path, [{"prompt": "a", "target": "b"}, {"prompt": "a"}]))
    with pytest.raises(ValueError, match=r"line 1 is not JSON"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text("{nope\n")
        read_pairs(bad)
    with pytest.raises(ValueError, match="holds no examples"):
        read_pairs(jsonl(tmp_path, [], "empty.jsonl"))
    assert read_pairs(jsonl(tmp_path, [{"q": "1", "a": "2"}], "k.jsonl"), "q", "a") == [("1", "2")]
    with pytest.raises(ValueError, match=r"example 1 has characters \['é'\]"):
        build_sft_policy(tmp_path / "o", jsonl(tmp_path, [{"prompt": "é", "target": "e"}], "u.jsonl"),
                         sft_steps=1, progress=False)
    assert not (tmp_path / "o").exists()


def test_a_recipe_can_name_it_as_its_prepare_step(tmp_path):
    """The launcher's check binds the recipe's kwargs to it, and it says its vocabulary size
    before it is built (for exported configs)."""
    import yaml

    from astralight.launch.check import check_recipe

    pairs = data(tmp_path)
    toy = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "toy" /
                          "recipe.yaml").read_text())
    toy["prepare"] = {"function": "astralight.tasks.sft_warmstart.build_sft_policy",
                      "kwargs": {"data_path": str(pairs), "sft_steps": 10, "num_threads": 1}}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(toy))
    result = check_recipe(recipe, components=False)
    assert str(pairs) in result.paths
    assert build_sft_policy.vocab_size() == 96
