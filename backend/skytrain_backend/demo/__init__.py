"""``skytrain demo``: watch SmolLM2-135M-Instruct learn a task with GRPO on this machine.

The demo is a client of skytrain like any other, plus the control plane it starts for
itself: ``service`` runs ``skytrain serve`` embedded (SQLite and a local directory under the
demo's home, the ``local`` provider starting a worker), ``training`` is the RL loop written
against the SDK alone, ``task`` is the task and its reward (pure functions), and ``report``
prints the table and draws the reward curves. Nothing here imports torch at import time.
"""

from skytrain_backend.demo.run import DemoOptions, DemoResult, run_demo
from skytrain_backend.demo.training import LoopOptions

__all__ = ["DemoOptions", "DemoResult", "LoopOptions", "run_demo"]
