"""tinker-cookbook's ``sl_basic`` recipe, run by the cookbook's own loop against ``skytrain
serve`` offline (``examples/tinker/cookbook_sl_basic.py``): it trains, saves, and its default
evaluator (``SamplerNLLEvaluator``, through ``compute_logprobs``) scores the held-out part."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from tests.fixtures.service import Service
from tests.tinker.conftest import tinker_key

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

pytest.importorskip(
    "tinker_cookbook",
    reason="tinker-cookbook 0.6.1 is not installed (see examples/tinker/cookbook_sl_basic.py "
    "for the pip command): the recipe cannot run",
)


def test_the_cookbooks_sl_basic_recipe_trains_and_evaluates_on_skytrain(
    tinker_service: Service, base_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples.tinker import cookbook_sl_basic

    monkeypatch.setenv("TINKER_API_KEY", tinker_key(tinker_service, "gina"))
    config = cookbook_sl_basic.build_config(
        base_url=tinker_service.url,
        model=base_model,
        data=cookbook_sl_basic.example_conversations(),
        log_path=tmp_path / "sl_basic",
        test_size=4,
        batch_size=8,
        max_length=256,
        max_steps=3,
        eval_every=2,
        lora_rank=8,
    )
    steps = cookbook_sl_basic.run(config)
    print(f"sl_basic metrics: {steps}")
    assert [step["step"] for step in steps] == [0, 1, 2]
    evaluated = [step["test/nll"] for step in steps if "test/nll" in step]
    assert len(evaluated) == 2 and all(math.isfinite(nll) for nll in evaluated)
    # Step 0 is evaluated before any update: a fresh adapter adds nothing, so the evaluator's
    # NLL (compute_logprobs on skytrain's sampler) is the base model's, computed here directly.
    assert evaluated[0] == pytest.approx(_base_model_nll(config, base_model), rel=1e-4)


def _base_model_nll(config: Any, base_model: str) -> float:
    """``-sum(logprob * weight) / sum(weight)`` over the held-out datums, with transformers."""
    transformers_logging.disable_progress_bar()
    _, test_set = config.dataset_builder()
    datums = [datum for i in range(len(test_set)) for datum in test_set.get_batch(i)]
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    total = weights = 0.0
    for datum in datums:
        tokens = torch.tensor([datum.model_input.to_ints()])
        targets = torch.as_tensor(datum.loss_fn_inputs["target_tokens"].data)
        weight = torch.as_tensor(datum.loss_fn_inputs["weights"].data, dtype=torch.float32)
        with torch.no_grad():
            logprobs = model(tokens).logits[0].float().log_softmax(dim=-1)
        chosen = logprobs.gather(-1, targets[:, None].long())[:, 0]
        total -= float((chosen * weight).sum())
        weights += float(weight.sum())
    return total / weights
