"""ART's newest client, unmodified, trains on skytrain: openpipe-art 0.5.23 on Python 3.12.

A real ``skytrain serve`` (embedded setup, local provider: a worker with the CPU engine and the
trainer on the tiny model) and ART's ``ServerlessBackend`` in ART's own environment
(``art_client_flow.py``): register, rollouts through the model's endpoint, two
``backend.train()`` calls with ART's defaults, ``:step<N>`` inference,
``model.delete_checkpoints()`` and ``backend.delete(model)``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.service import Service

pytestmark = pytest.mark.e2e

FLOW = Path(__file__).with_name("art_client_flow.py")


@pytest.mark.slow
def test_arts_serverless_backend_trains_serves_and_cleans_up(
    embedded_service: Service, art_python: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    result = subprocess.run(
        [
            str(art_python),
            "-P",
            str(FLOW),
            embedded_service.url,
            embedded_service.key("art"),
            str(tiny_model_path),
        ],
        cwd=tmp_path,  # ART writes its local history under .art/ here
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])

    assert seen["registered_step"] == 0
    assert (seen["first"]["step"], seen["second"]["step"]) == (1, 2)
    # ART's own summary of each job: the trainer's loss and gradient norm came through.
    for job in ("first", "second"):
        assert {"loss/train", "loss/grad_norm"} <= set(seen[job]["metrics"])
    assert seen["served_after_first"] == "1"
    assert seen["served_after_second"] == {"1": "1", "2": "2"}
    # delete_checkpoints keeps the latest (no local history names a best one): step 1 goes.
    assert seen["served_after_delete_checkpoints"] == {"1": 404, "2": "2"}
    assert seen["step_after_delete_checkpoints"] == 2
    assert seen["served_after_delete"] == 404
