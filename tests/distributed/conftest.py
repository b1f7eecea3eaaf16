"""The distributed tier: real multi-process runs of the trainer over gloo, many runs per torchrun start."""

from __future__ import annotations

import pytest

from tests.support.batches import Batches


@pytest.fixture(scope="session")
def batches(request, tmp_path_factory):
    """Every run the selected tests name in ``@pytest.mark.runs(...)``, one torchrun start per world size."""
    names = {name for item in request.session.items for mark in item.iter_markers("runs") for name in mark.args}
    started = Batches(tmp_path_factory.mktemp("batches"), names)
    yield started
    started.close()
