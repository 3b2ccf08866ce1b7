"""The PreToolUse hook's start: the file the Claude Code drop-in runs on every file-tool call.

The drop-in runs ``PYTHON -I -S <this file> EXE pretooluse`` (``claude.hookCommand``):
the hook as ``EXE hook pretooluse`` would run it, with ``EXE`` as ``argv[0]`` so
a policy built here names the same command (``policy.executable``), but
without the console script, the CLI or ``site``.  ``-I`` keeps Claude Code's
environment (``PYTHONPATH``, ``PYTHONSTARTUP``, the user's site dir, the cwd)
out of the hook's imports; ``-S`` skips ``site``, whose ``.pth`` files cost the
interpreter more than the hook's whole decision on Debian (bench/hook.py).
Without ``site`` the package's own directory is not on ``sys.path``: it is the
one this file lies in, appended after the standard library as ``site`` would
append it.  The hook needs nothing but the standard library and its own modules.

Run as a script, this file is compiled on every start: keep it short.  If the
hook cannot even be imported, the call is denied (Claude Code 2.1.197 runs a
tool whose hook failed).
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.argv[:2] = sys.argv[1:2]
try:
    from agentsandbox.hook import main
except BaseException:
    if sys.argv[1:] == ["pretooluse"]:
        os.write(
            1,
            b'{"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "deny", '
            b'"permissionDecisionReason": "agentsandbox refused this call: the hook could not start"}}\n',
        )
        sys.exit(0)
    raise
sys.exit(main(sys.argv[1:]))
