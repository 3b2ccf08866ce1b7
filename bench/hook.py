"""How long one PreToolUse hook call takes, against Python's own start-up.

Claude Code runs the hook before every file-tool call, so its cost is paid on
every Read and Edit.  The goal: the median wall time over ``--runs`` calls is at
most 1.2x the median of ``python3 -c pass`` measured in the same run with the
same interpreter.  The hook is started exactly as the installed drop-in starts
it: the command and args of the PreToolUse hook ``claude.render`` writes for
this interpreter and this checkout (``claude.hookCommand``), on a fixture user
with a real config, deciding a denied Read (the slower path: it builds the
reason).  The two commands alternate, so a neighbour's load falls on both.

Beside wall time, the user+sys CPU time each child used (``os.wait4``), which a
shared machine disturbs less, and, where valgrind is installed, the instructions
each command runs (callgrind's count: the same from run to run, whatever the
load; ``perf stat`` is not used because containers seldom allow it).  The goal
is stated on wall time.

    python3 bench/hook.py [--runs 50] [--no-instructions]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentsandbox import claude  # noqa: E402  (the checkout, not an installed copy)
from agentsandbox.loader import load  # noqa: E402
from agentsandbox.policy import Policy  # noqa: E402

GOAL = 1.2


def runChild(cmd: list[str], stdin: bytes, env: dict[str, str]) -> tuple[float, float, bytes]:
    """Wall seconds, user+sys CPU seconds and stdout of one run of ``cmd``."""
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(stdin)
    child.stdin.close()
    out = child.stdout.read()
    child.stdout.close()
    # wait4 rather than Popen.wait: it also returns the child's rusage.
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{cmd} exited {child.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, out


def instructions(cmd: list[str], stdin: bytes, env: dict[str, str]) -> int:
    """Instructions ``cmd`` runs under callgrind (the median of three)."""
    counts = []
    for _ in range(3):
        p = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd],
                           input=stdin, capture_output=True, env=env, check=True)
        found = re.search(rb"Collected : (\d+)", p.stderr)
        assert found is not None, p.stderr
        counts.append(int(found.group(1)))
    return int(statistics.median(counts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--no-instructions", action="store_true", help="skip the callgrind counts")
    args = parser.parse_args()
    counted: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="agentsandbox-bench-") as base:
        home = Path(base) / "home"
        (home / "projects/repo").mkdir(parents=True)
        (Path(base) / "tmp").mkdir()
        config = home / ".config/agentsandbox/config.toml"
        config.parent.mkdir(parents=True)
        config.write_text('[sandbox]\nread = ["~/projects"]\nwrite = ["~/work"]\ndomains = ["example.org"]\n')
        env = {"HOME": str(home), "TMPDIR": str(Path(base) / "tmp"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        policy = Policy.fromConfig(load(None, env), env)
        (entry,) = claude.render(policy)["hooks"]["PreToolUse"][0]["hooks"]
        hook = [entry["command"], *entry["args"]]
        event = json.dumps(
            {
                "tool_name": "Read",
                "tool_input": {"file_path": "~/.ssh/id_ed25519"},
                "cwd": str(home / "projects/repo"),
                "hook_event_name": "PreToolUse",
            }
        ).encode()
        baseline = [sys.executable, "-c", "pass"]
        # The first call writes the policy cache (and any stale .pyc); it is not counted.
        first = runChild(hook, event, env)[2]
        assert b'"permissionDecision": "deny"' in first, first
        times: dict[str, tuple[list[float], list[float]]] = {"baseline": ([], []), "hook": ([], [])}
        for _ in range(args.runs):
            for name, cmd, stdin in (("baseline", baseline, b""), ("hook", hook, event)):
                wall, cpu, _ = runChild(cmd, stdin, env)
                times[name][0].append(wall)
                times[name][1].append(cpu)
        if shutil.which("valgrind") and not args.no_instructions:
            counted = {"baseline": instructions(baseline, b"", env), "hook": instructions(hook, event, env)}
        cache = home / ".local/state/agentsandbox/policy-cache.json"
        cold = []
        for _ in range(max(5, args.runs // 10)):
            cache.unlink(missing_ok=True)
            cold.append(runChild(hook, event, env)[0])
    medianWall = {name: statistics.median(t[0]) for name, t in times.items()}
    medianCpu = {name: statistics.median(t[1]) for name, t in times.items()}
    ratio = medianWall["hook"] / medianWall["baseline"]
    print(f"interpreter              {sys.executable} (Python {sys.version.split()[0]})")
    print(f"hook command             {' '.join(hook)}")
    print(f"python3 -c pass          {medianWall['baseline'] * 1000:7.1f} ms wall {medianCpu['baseline'] * 1000:7.1f} ms cpu"
          f"  (medians of {args.runs})")
    print(f"hook pretooluse          {medianWall['hook'] * 1000:7.1f} ms wall {medianCpu['hook'] * 1000:7.1f} ms cpu"
          f"  (medians of {args.runs}, policy cache warm)")
    print(f"hook, config re-read     {statistics.median(cold) * 1000:7.1f} ms wall"
          f"  (median of {len(cold)}, first call after a config change)")
    print(f"cpu ratio hook / pass    {medianCpu['hook'] / medianCpu['baseline']:7.2f}x")
    if counted:
        print(f"instructions hook / pass {counted['hook'] / counted['baseline']:7.2f}x"
              f"  ({counted['hook'] / 1e6:.1f}M / {counted['baseline'] / 1e6:.1f}M, callgrind)")
    print(f"ratio hook / baseline    {ratio:7.2f}x  (wall; goal <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
