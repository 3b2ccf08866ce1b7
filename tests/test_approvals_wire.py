"""The control wire's values (agentsandbox/approvals.py): what the CLI and the service exchange."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentsandbox.approvals import Answer, HeldRequest, controlSocket, decode, encode


def test_a_held_request_crosses_the_wire_unchanged() -> None:
    held = HeldRequest("h1", "example.org", 443, "connect", "127.0.0.1:5000", "1234 curl", 10.5)
    assert HeldRequest.fromWire(decode(encode(held.toWire()))) == held


def test_an_answer_crosses_the_wire_unchanged() -> None:
    answer = Answer("allow", "for", 600.0, by="cli pid 99")
    assert Answer.fromWire(decode(encode(answer.toWire()))) == answer


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"verdict": "maybe", "scope": "once"}, "verdict must be allow or deny"),
        ({"verdict": "allow", "scope": "forever"}, "scope must be once, for or always"),
        ({"verdict": "allow", "scope": "for", "seconds": -1}, "seconds must be a positive number"),
        ({"verdict": "allow", "scope": "for", "seconds": "10"}, "seconds must be a positive number"),
    ],
)
def test_a_bad_answer_is_refused_with_the_reason(data: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Answer.fromWire(data)


@pytest.mark.parametrize(
    ("line", "words"), [(b"{nope", "not JSON"), (b"[1]", "must be a JSON object"), (b"\xff", "not JSON")]
)
def test_a_bad_line_is_refused_with_the_reason(line: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode(line)


def test_the_socket_lives_in_the_users_runtime_directory() -> None:
    assert controlSocket("/run/user/1000") == "/run/user/1000/agentsandbox/control.sock"


def test_the_wire_imports_no_twisted() -> None:
    code = "import sys, agentsandbox.approvals; print(any(m.startswith('twisted') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
