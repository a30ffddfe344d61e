"""WeightPublisher during a weight-store outage (a full disk answers 507): training goes on,
each refused version is counted, and publication resumes with a full version once the store has
room; a refusal of the *last* version is retried (in full, with backoff) before fit ends, and
fails the fit if the store never recovers (the dataflow must not stay behind while the trainer
exits 0)."""

from __future__ import annotations

import pytest

from astralight.callbacks import WeightPublisher
from astralight.dataflow.client import DataflowError
from tests.unit.publisher_fit import FlushEachStep, fit
from tests.fakes import FakeDataflowClient


class FullDisk(FakeDataflowClient):
    """Uploads of the versions in ``full`` are refused once each, as a full weight store does."""

    def __init__(self, *args, full: set[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.full = set(full)
        self.refused: list[int] = []

    def upload_weight_file(self, model_id, version, name, data):
        if version in self.full:
            self.full.discard(version)
            self.refused.append(version)
            raise DataflowError(507, "weight store is full (No space left on device)", "disk")
        return super().upload_weight_file(model_id, version, name, data)


def test_refused_versions_are_counted_and_publication_resumes_full(tiny_model_dir):
    fake = FullDisk(tiny_model_dir, full={2, 3})
    publisher = WeightPublisher(full_every=10, worker="thread")
    publisher.client = fake
    fit(tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 5)
    assert fake.refused == [2, 3] and publisher.errors == 2 and "507" in publisher.last_error
    assert [(m.version, m.kind) for m in fake.manifests] == [
        (1, "full"), (4, "full"), (5, "delta")]
    assert len(fake.acks) == 5  # training never waited for the weight store


def test_a_refused_last_version_is_published_before_fit_ends(tiny_model_dir):
    fake = FullDisk(tiny_model_dir, full={4})
    publisher = WeightPublisher(full_every=10, worker="thread")
    publisher.client = fake
    fit(tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 4)
    assert fake.refused == [4]
    assert fake.manifests[-1].version == 4, [m.version for m in fake.manifests]


class AlwaysFull(FullDisk):
    def upload_weight_file(self, model_id, version, name, data):
        if version >= 3:
            self.refused.append(version)
            raise DataflowError(507, "weight store is full (No space left on device)", "disk")
        return super().upload_weight_file(model_id, version, name, data)


def test_a_last_version_that_never_fits_fails_the_fit(tiny_model_dir):
    fake = AlwaysFull(tiny_model_dir, full=set())
    publisher = WeightPublisher(full_every=10, worker="thread", flush_timeout_s=2.0)
    publisher.client = fake
    with pytest.raises(RuntimeError, match="version 3 .* could not be published"):
        fit(tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 3)
