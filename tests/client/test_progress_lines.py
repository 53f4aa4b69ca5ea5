"""The SDK's progress bars with stderr redirected (issue 36: `\\r`-redrawn bars filled log
files): plain lines, when a bar starts and ends and at most every 10 s between."""

from __future__ import annotations

import subprocess
import sys

GATHER = """
import asyncio, skytrain

async def rollout(i):
    await asyncio.sleep(0.01 * i)
    message = {"role": "user", "content": "hi"}
    return skytrain.Trajectory(messages_and_choices=[message], reward=float(i))

async def main():
    await skytrain.gather_trajectory_groups(
        skytrain.TrajectoryGroup(rollout(i) for i in range(4)) for _ in range(3)
    )

asyncio.run(main())
"""


def test_a_bar_into_a_pipe_prints_plain_lines() -> None:
    result = subprocess.run(
        [sys.executable, "-c", GATHER], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "\x1b[" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("gather:   0%") and "0/12" in lines[0]
    assert lines[-1].startswith("gather: 100%") and "12/12" in lines[-1]
    assert len(lines) <= 4  # start, end, and a line per 10 s at most
