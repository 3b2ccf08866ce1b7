"""The tripwire: every tool an installed Claude Code offers is in our table.

The policy holds the tools it knows; a release that adds one must fail here,
naming it, before any user meets it.  The capture (tests/support/claude_tools.py)
reads the tools from the request bodies the real binary sends the mock Messages
API, deferred tools loaded through ToolSearch and optional ones included.
"""

from __future__ import annotations

import pytest

from agentsandbox.tools import TOOLS
from tests.support.claude_harness import ClaudeBinary
from tests.support.claude_tools import capture, checkAllKnown, unknownTools


@pytest.mark.claude
def test_every_offered_tool_is_classified(claude: ClaudeBinary) -> None:
    captured = capture(claude)
    # The capture itself must have worked: the core tools and the deferred
    # mechanism's products are there, so an empty or broken run cannot pass.
    for core in ("Bash", "Read", "Write", "Edit", "Glob", "Grep"):
        assert core in captured.tools, f"{core} missing from {sorted(captured.tools)}"
        assert captured.tools[core].get("properties"), f"{core} has no schema"
    checkAllKnown({captured.release: captured.tools}, TOOLS)


@pytest.mark.claude
def test_deferred_tools_get_their_schemas(claude: ClaudeBinary) -> None:
    """A tool loaded only through ToolSearch is captured with its real schema."""
    captured = capture(claude)
    assert captured.deferred, "no deferred tool seen: tool search did not switch on"
    for name in ("EnterWorktree", "WebFetch", "NotebookEdit"):
        assert name in captured.deferred, sorted(captured.deferred)
        assert "properties" in captured.tools[name], (name, captured.tools[name])


def test_an_unknown_tool_fails_naming_it_and_its_release() -> None:
    known = {"Bash": "runs", "Read": "reads"}
    captured = {"2.1.197": ["Bash", "Read"], "9.9.9": ["Bash", "Read", "Teleport", "Xyzzy"]}
    assert unknownTools(captured, known) == {"9.9.9": ["Teleport", "Xyzzy"]}
    with pytest.raises(AssertionError) as failure:
        checkAllKnown(captured, known)
    message = str(failure.value)
    assert "Teleport (Claude Code 9.9.9)" in message
    assert "Xyzzy (Claude Code 9.9.9)" in message
    assert "2.1.197" not in message


def test_a_made_up_tool_added_to_a_real_table_fails() -> None:
    """The same check over the shipped table: a name it lacks is named."""
    offered = [*TOOLS, "MadeUpTool_4f2a"]
    with pytest.raises(AssertionError, match=r"MadeUpTool_4f2a \(Claude Code 3\.0\.0\)"):
        checkAllKnown({"3.0.0": offered}, TOOLS)
    checkAllKnown({"3.0.0": list(TOOLS)}, TOOLS)
