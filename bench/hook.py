"""How long one ``agentsandbox hook pretooluse`` takes, against Python's own start-up.

Claude Code runs the hook before every file-tool call, so its cost is paid on
every Read and Edit.  The goal: the median over 50 runs is at most 2.0x the
median of ``python3 -c pass`` measured in the same run with the same
interpreter.  The hook is started the way an installed console script starts
it (import ``agentsandbox.cli`` and call ``main``), on a fixture user with a
real config, deciding a denied Read (the slower path: it builds the reason).

    python3 bench/hook.py [--runs 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOAL = 2.0


def median(cmd: list[str], stdin: bytes, env: dict[str, str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, input=stdin, stdout=subprocess.DEVNULL, env=env, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentsandbox-bench-") as base:
        home = Path(base) / "home"
        (home / "projects/repo").mkdir(parents=True)
        config = home / ".config/agentsandbox/config.toml"
        config.parent.mkdir(parents=True)
        config.write_text('[sandbox]\nread = ["~/projects"]\nwrite = ["~/work"]\ndomains = ["example.org"]\n')
        env = {
            "HOME": str(home),
            "TMPDIR": str(Path(base) / "tmp"),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(REPO),
        }
        event = json.dumps(
            {
                "tool_name": "Read",
                "tool_input": {"file_path": "~/.ssh/id_ed25519"},
                "cwd": str(home / "projects/repo"),
                "hook_event_name": "PreToolUse",
            }
        ).encode()
        hook = [sys.executable, "-c", "import sys; from agentsandbox.cli import main; sys.exit(main())", "hook", "pretooluse"]
        first = subprocess.run(hook, input=event, capture_output=True, env=env, check=True)
        assert b'"permissionDecision": "deny"' in first.stdout, first
        baseline = median([sys.executable, "-c", "pass"], b"", env, args.runs)
        warm = median(hook, event, env, args.runs)
        cache = home / ".local/state/agentsandbox/policy-cache.json"
        cold = []
        for _ in range(max(5, args.runs // 10)):
            cache.unlink(missing_ok=True)
            cold.append(median(hook, event, env, 1))
        coldMedian = statistics.median(cold)
    ratio = warm / baseline
    print(f"interpreter              {sys.executable} (Python {sys.version.split()[0]})")
    print(f"python3 -c pass          {baseline * 1000:7.1f} ms  (median of {args.runs})")
    print(f"hook pretooluse          {warm * 1000:7.1f} ms  (median of {args.runs}, policy cache warm)")
    print(f"hook, config re-read     {coldMedian * 1000:7.1f} ms  (median of {len(cold)}, first call after a config change)")
    print(f"ratio hook / baseline    {ratio:7.2f}x  (goal <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
