"""The CPU engine with SmolLM2-135M-Instruct: its sleep gives the weights' memory back.

(Answers that must make sense, tool calls and the end-of-sequence token are the contract both
engines pass: tests/engine/test_engine_contract.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.engine.conftest import RunningEngine

pytestmark = pytest.mark.slow

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
TOKEN_IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_path)


def _resident_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS in /proc status")


async def test_sleep_gives_the_weights_memory_back_and_wake_up_restores_the_model(
    smollm2_engine: RunningEngine,
) -> None:
    pid = smollm2_engine.process.pid
    assert pid is not None
    client = smollm2_engine.openai()
    before = client.chat.completions.create(
        model="smollm2", messages=CAPITAL, temperature=0, max_tokens=20
    )
    awake = _resident_mib(pid)
    async with smollm2_engine.client() as engine:
        await engine.sleep()
        try:
            asleep = _resident_mib(pid)
        finally:
            await engine.wake_up()
    # 135M parameters in float32 are 515 MiB; most of it must leave the process.
    assert awake - asleep > 300, (awake, asleep)
    after = client.chat.completions.create(
        model="smollm2", messages=CAPITAL, temperature=0, max_tokens=20
    )
    assert after.choices[0].message.content == before.choices[0].message.content
