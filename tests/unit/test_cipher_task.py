"""The structured task (astralight/tasks/cipher.py): one cipher behind every answer, a warm
start that saw a minority of the words and of the letters."""

from __future__ import annotations

import pytest

from astralight.tasks.cipher import CipherSource, CipherTable, build_cipher_policy
from astralight.tasks.sft_warmstart import read_pairs


def test_every_answer_follows_one_seeded_cipher():
    table = CipherTable(seed=0)
    assert table.num_keys == 16**3 and len(set(table.words)) == table.num_keys
    for k in (0, 17, 4095):
        word = table.words[k]
        assert table.answer(k) == "".join(table.cipher[c] for c in word)
        assert table.prompt(k).prompt == f"{word}=" and table.prompt(k).metadata == {
            "answer": table.answer(k)}
    again = CipherTable(seed=0)
    assert again.cipher == table.cipher and again.seen == table.seen
    assert CipherTable(seed=1).cipher != table.cipher
    known_digits = [table.cipher[c] for c in table.known]
    assert len(table.known) == 8 and len(set(known_digits)) == 8  # a digit each
    # every unknown letter shares a digit the warm start was trained to write
    assert {table.cipher[c] for c in table.cipher} == set(known_digits)


def test_the_warm_start_sees_a_minority_of_words_made_of_known_letters_only(tmp_path):
    table = CipherTable(seed=0)
    known = set(table.known)
    known_words = [k for k, w in enumerate(table.words) if set(w) <= known]
    assert len(table.seen) == len(known_words) // 2 == 256
    assert all(set(table.words[k]) <= known for k in table.seen)
    assert set(table.seen).isdisjoint(table.unseen)
    assert sorted(table.seen + table.unseen) == list(range(table.num_keys))
    # most unseen words hold a letter the warm start never saw: RL discovers its digit once
    with_unknown = [k for k in table.unseen if not set(table.words[k]) <= known]
    assert len(with_unknown) > 0.8 * len(table.unseen)
    pairs = read_pairs(table.write_pairs(tmp_path / "seen.jsonl"))
    assert pairs == [(table.prompt(k).prompt, table.answer(k)) for k in table.seen]


def test_eval_is_the_unseen_words_and_train_draws_every_word():
    table = CipherTable()
    ev = CipherSource("eval")
    assert len(ev) == 300 and [ev.get(i).prompt for i in range(3)] == [
        table.prompt(k).prompt for k in table.unseen[:3]]
    with pytest.raises(IndexError):
        ev.get(300)
    train = CipherSource("train")
    drawn = {train.get(i).prompt for i in range(20000)}
    assert len(drawn) > 0.95 * table.num_keys
    assert train.get(5) == CipherSource("train").get(5)


@pytest.mark.parametrize("kwargs, field", [({"word_len": 0}, "word_len"),
                                           ({"letters": "aa"}, "letters"),
                                           ({"known_letters": 11}, "known_letters"),
                                           ({"known_letters": 0}, "known_letters"),
                                           ({"seen_share": 1.0}, "seen_share")])
def test_bad_table_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CipherTable(**kwargs)
    with pytest.raises(ValueError, match="split"):
        CipherSource("test")


def test_the_warm_start_declares_the_tiny_models_vocabulary():
    assert build_cipher_policy.vocab_size() == 96
