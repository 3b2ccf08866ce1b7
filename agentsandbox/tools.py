"""Placeholder: the classified table of Claude Code's tools is written elsewhere.

This stands in so the tripwire test (tests/test_claude_tools.py) imports; it
is replaced by the real table, which maps every tool name to its class.
"""

from __future__ import annotations

TOOLS: dict[str, object] = {}
