"""Write tests/durations.json (seconds per test file) from a pytest run's ``--durations=0``.

    scripts/test.sh --durations=0 | tee run.log
    .venv/bin/python bench/test_durations.py run.log

The suite orders its files by it, longest first (tests/conftest.py), so its processes finish
together. Only the order depends on it: a stale file makes a run slower, never wrong.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+([^:\s]+)::")
OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def main(log: str) -> None:
    seconds: Counter[str] = Counter()
    for line in Path(log).read_text(errors="replace").splitlines():
        found = LINE.match(line)
        if found:
            seconds[found.group(2)] += float(found.group(1))
    if not seconds:
        raise SystemExit(f"{log}: no durations (run pytest with --durations=0)")
    ordered = {name: round(value, 1) for name, value in seconds.most_common()}
    OUT.write_text(json.dumps(ordered, indent=1) + "\n")
    total = sum(seconds.values())
    print(f"{OUT}: {len(ordered)} files, {total:.0f} s in all; the longest:")
    for name, value in seconds.most_common(10):
        print(f"  {value:7.1f} s  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
