"""Plugin specs from YAML: short names, import paths and {class_path, init_args} all normalise to
the form jsonargparse builds; typos fail with the config location and the accepted forms."""

from __future__ import annotations

import pytest

from astralight.dataflow.config import instantiate_plugin
from astralight.dataflow.curators import GRESO, AcceptAll, FilterSolved, PromptCurator
from astralight.dataflow.plugins import ALIASES, BUILT_INS as REGISTRY, DataPlugin, normalize_spec
from astralight.dataflow.replay import HighVariance, Latest, ReplaySelector, Uniform
from astralight.dataflow.sample_filters import KeepAll, LengthFilter, SampleFilter, ZeroAdvantage

BUILT_INS = {
    "accept_all": (AcceptAll, PromptCurator), "filter_solved": (FilterSolved, PromptCurator),
    "greso": (GRESO, PromptCurator), "keep_all": (KeepAll, SampleFilter),
    "zero_advantage": (ZeroAdvantage, SampleFilter), "length": (LengthFilter, SampleFilter),
    "latest": (Latest, ReplaySelector), "uniform": (Uniform, ReplaySelector),
    "high_variance": (HighVariance, ReplaySelector),
}


def test_aliases_cover_every_builtin_and_the_queue_orders():
    assert set(ALIASES) == set(BUILT_INS) | {"fifo", "edf", "freshest"}
    assert ALIASES["fifo"] == "astralight.dataflow.queues.Fifo"
    assert ALIASES["edf"] == "astralight.dataflow.queues.Edf"
    assert ALIASES["freshest"] == "astralight.dataflow.queues.Freshest"


def test_short_names_are_unique_across_hooks():
    assert len(ALIASES) == sum(len(names) for names in REGISTRY.values())
    assert set(REGISTRY["queue_order"]) == {"fifo", "edf", "freshest"}


@pytest.mark.parametrize("where, hook", [("curators[0]", "curators"),
                                         ("sample_filters[2]", "sample_filters"),
                                         ("replay.selectors[0]", "replay.selectors"),
                                         ("queue_order", "queue_order"),
                                         ("queue_order.policy[1]", "queue_order")])
def test_unknown_plugin_message_lists_only_that_hooks_short_names(where, hook):
    with pytest.raises(ValueError) as err:
        normalize_spec("nope", where)
    msg = str(err.value)
    assert msg.startswith(where)
    for short in ALIASES:
        assert (f"{short}," in msg or f"{short})" in msg) == (short in REGISTRY[hook])
    other = next(s for h, names in REGISTRY.items() if h != hook for s in names)
    with pytest.raises(ValueError, match="unknown plugin"):
        normalize_spec(other, where)  # another hook's short name is not valid here


@pytest.mark.parametrize("alias", sorted(BUILT_INS))
def test_every_builtin_alias_builds_through_jsonargparse(alias):
    cls, base = BUILT_INS[alias]
    spec = normalize_spec(alias, "x[0]")
    assert spec == {"class_path": f"{cls.__module__}.{cls.__name__}", "init_args": {}}
    obj = instantiate_plugin(spec, base, "x[0]")
    assert type(obj) is cls and isinstance(obj, DataPlugin)
    # usable alone: a default generator that is seeded, so two fresh instances agree
    assert obj.rng.random() == cls().rng.random()


def test_dict_form_resolves_alias_and_keeps_init_args():
    spec = normalize_spec({"class_path": "greso", "init_args": {"p_easy": 0.7}}, "curators[0]")
    assert spec == {"class_path": "astralight.dataflow.curators.GRESO",
                    "init_args": {"p_easy": 0.7}}
    g = instantiate_plugin(spec, PromptCurator, "curators[0]")
    assert g.metrics()["p_easy"] == 0.7
    assert normalize_spec({"class_path": "latest"}, "s")["init_args"] == {}


def test_full_import_path_passes_unchanged():
    path = "tests.unit.my_plugins.MyCurator"
    assert normalize_spec(path, "curators[0]") == {"class_path": path, "init_args": {}}
    spec = {"class_path": path, "init_args": {"a": 1}}
    assert normalize_spec(spec, "curators[0]") == spec


@pytest.mark.parametrize("bad", ["gresso", "", "not a.path", 3, None, ["greso"],
                                 {"init_args": {}}, {"class_path": "greso", "extra": 1},
                                 {"class_path": "greso", "init_args": [1]}])
def test_bad_specs_name_the_location_and_the_accepted_forms(bad):
    with pytest.raises(ValueError) as err:
        normalize_spec(bad, "curators[1]")
    assert str(err.value).startswith("curators[1]")
    if not (isinstance(bad, dict) and isinstance(bad.get("init_args"), list)):
        assert "greso" in str(err.value) and "class_path" in str(err.value)


def test_bad_init_args_fail_at_build_time_with_the_location():
    spec = normalize_spec({"class_path": "greso", "init_args": {"p_easy": 2.0}}, "curators[0]")
    with pytest.raises(ValueError, match=r"curators\[0\].*p_easy"):
        instantiate_plugin(spec, PromptCurator, "curators[0]")
