"""The discovery task (astralight/tasks/facts.py); the bench that runs it against TRL is
tested in test_bench_vs_trl.py."""

from __future__ import annotations

import pytest

from astralight.tasks.facts import FactSource, FactTable, build_facts_policy
from astralight.tasks.sft_warmstart import read_pairs


def test_the_table_is_seeded_and_splits_keys_into_seen_and_unseen():
    table = FactTable(num_keys=200, seen_share=0.25, seed=0)
    again = FactTable(num_keys=200, seen_share=0.25, seed=0)
    assert table.answers == again.answers and table.seen == again.seen
    assert FactTable(num_keys=200, seed=1).answers != table.answers
    assert len(table.seen) == 50 and len(table.unseen) == 150
    assert set(table.seen).isdisjoint(table.unseen)
    assert set(table.seen) | set(table.unseen) == set(range(200))
    assert all(len(a) == 1 and a.isdigit() for a in table.answers)
    assert len(set(table.answers)) > 5  # arbitrary facts, not one answer
    p = table.prompt(7)
    assert p.prompt == "f007=" and p.metadata == {"answer": table.answers[7]}


def test_eval_is_the_unseen_facts_and_train_draws_every_key(tmp_path):
    table = FactTable()
    ev = FactSource("eval")
    assert len(ev) == 150 and [ev.get(i).prompt for i in range(3)] == [
        table.prompt(k).prompt for k in table.unseen[:3]]
    with pytest.raises(IndexError):
        ev.get(150)
    assert len(FactSource("eval", eval_size=10)) == 10
    train = FactSource("train")
    drawn = {train.get(i).prompt for i in range(3000)}
    assert drawn == {table.prompt(k).prompt for k in range(200)}
    assert train.get(5) == FactSource("train").get(5)  # get(i) depends on (seed, i) alone
    pairs = read_pairs(table.write_pairs(tmp_path / "seen.jsonl"))
    assert pairs == [(table.prompt(k).prompt, table.answers[k]) for k in table.seen]


@pytest.mark.parametrize("kwargs, field", [({"num_keys": 1}, "num_keys"),
                                           ({"seen_share": 1.0}, "seen_share"),
                                           ({"answer_len": 0}, "answer_len"),
                                           ({"alphabet": "aa"}, "alphabet")])
def test_bad_table_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FactTable(**kwargs)
    with pytest.raises(ValueError, match="split"):
        FactSource("test")


def test_the_warm_start_needs_a_seen_fact_and_declares_its_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="seen_share"):
        build_facts_policy(tmp_path / "m", seen_share=0.0)
    assert not (tmp_path / "m").exists()
    assert build_facts_policy.vocab_size() == 96
