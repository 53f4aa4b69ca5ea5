"""The CPU engine's prompt scoring (``ModelRunner.score_prompt``), run chunk by chunk through
its output layer, gives what one plain forward pass of the model gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from skytrain_backend.engine.hf import runner as runner_module
from skytrain_backend.engine.hf.runner import ModelRunner


def test_scoring_in_chunks_equals_a_plain_forward_pass(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers_logging.disable_progress_bar()
    prompt = [1, 17, 230, 5, 99, 4, 12, 40, 7, 300, 2]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    runner = ModelRunner(str(tiny_model_path), dtype="float32", device="cpu")
    whole = runner.score_prompt(prompt, None, k=3)
    monkeypatch.setattr(runner_module, "SCORE_CHUNK", 3)  # 10 positions: 4 chunks
    chunked = runner.score_prompt(prompt, None, k=3)
    assert runner._plain_output_layer()
    for scored in (whole, chunked):
        assert len(scored) == len(prompt) and scored[0] is None
        for position in range(1, len(prompt)):
            entry = scored[position]
            row = expected[position - 1]
            assert entry is not None and entry.token_id == prompt[position]
            assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
            assert entry.rank == int((row > row[prompt[position]]).sum()) + 1
            values, ids = row.topk(3)
            assert [token for token, _ in entry.top] == ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
