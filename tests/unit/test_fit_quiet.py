"""``astralight fit`` silences the Lightning lines that never apply to it (the ``args`` warning,
the manual-optimization ``ModelCheckpoint`` warning, Lightning's pytree deprecation, the
litlogger tip) and nothing else."""

from __future__ import annotations

import logging
import warnings

from astralight.trainer.trainer_cli import QUIET_INFO, QUIET_WARNINGS, quiet_lightning_noise


def test_the_noise_is_silenced_and_other_warnings_stay(caplog):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_lightning_noise()
        for prefix in QUIET_WARNINGS:
            warnings.warn(prefix + " (the rest of Lightning's message)", UserWarning)
        warnings.warn("a warning that matters", UserWarning)
    assert [str(w.message) for w in seen] == ["a warning that matters"]

    caplog.set_level(logging.INFO)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero.info(QUIET_INFO[0] + " and experiment tracking, try installing [litlogger]")
    rank_zero.info("GPU available: False, used: False")
    assert "litlogger" not in caplog.text and "GPU available" in caplog.text
    quiet_lightning_noise()  # twice: one filter, not two
    assert len(rank_zero.filters) == 1
