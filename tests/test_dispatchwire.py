"""The dispatcher's wire (``egress/dispatchwire.py``): its line reader, and the
status query ``run`` and ``doctor`` make without importing Twisted."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agentsandbox.egress.dispatchwire import (
    MAX_LINE,
    DispatchQueryError,
    LineReader,
    WireError,
    askStatus,
    encode,
)
from tests.support.broker_support import pythonEnv

# --------------------------------------------------------------------------- the wire


def test_line_reader_splits_and_buffers() -> None:
    r = LineReader()
    assert r.feed(b'{"op": "register"}\n{"op"') == [{"op": "register"}]
    assert r.feed(b': "status", "uid": 0}\n') == [{"op": "status", "uid": 0}]
    assert r.pending == 0


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\xff\xfe\n", "not JSON"),
        (b"[1, 2]\n", "JSON object"),
        (b'{"uid": 0}\n', "JSON object"),
        (b"{" + b"x" * MAX_LINE + b"}", "longer than"),
        (b"{" + b"x" * MAX_LINE + b"}\n", "longer than"),
    ],
)
def test_line_reader_refuses_bad_input(data: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        LineReader().feed(data)


def test_encode_is_one_line() -> None:
    assert encode({"op": "conn"}) == b'{"op":"conn"}\n'


# --------------------------------------------------------------------------- the status query


def _answerOnce(path: str, reply: bytes) -> threading.Thread:
    """A Unix socket at ``path`` that reads one line and answers ``reply``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def answer() -> None:
        with listener, listener.accept()[0] as conn:
            request = b""
            while not request.endswith(b"\n"):
                request += conn.recv(4096)
            assert request == encode({"op": "status"})
            conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_ask_status_adds_who_answered(tmp_path: Path) -> None:
    path = str(tmp_path / "dispatch.sock")
    thread = _answerOnce(path, encode({"op": "status", "pid": 7, "ports": ["127.0.0.1:3128"]}))
    assert askStatus(path) == {"op": "status", "pid": 7, "ports": ["127.0.0.1:3128"], "answeredBy": os.getuid()}
    thread.join()


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (b"not json\n", "answered something that is not JSON"),
        (encode({"op": "error", "error": "no"}), "answered {'error': 'no', 'op': 'error'}"),
    ],
)
def test_ask_status_says_what_the_answer_was(tmp_path: Path, reply: bytes, said: str) -> None:
    path = str(tmp_path / "dispatch.sock")
    thread = _answerOnce(path, reply)
    with pytest.raises(DispatchQueryError, match=re.escape(f"the dispatcher on {path} {said}")):
        askStatus(path)
    thread.join()


def test_ask_status_without_a_dispatcher_says_where(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.sock")
    with pytest.raises(DispatchQueryError, match=f"no dispatcher answers on {path}"):
        askStatus(path)


#: A child that asks a dispatcher (an in-process stand-in on a real Unix
#: socket) the way ``run`` and ``doctor`` do, then lists the Twisted modules it imported.
_RUN_AND_DOCTOR = """
import json, os, socket, sys, threading
path = sys.argv[1]
listener = socket.socket(socket.AF_UNIX); listener.bind(path); listener.listen(2)
asked = []
def answer():
    for _ in range(2):
        conn, _ = listener.accept()
        asked.append(conn.recv(4096))
        reply = {"op": "status", "pid": 1, "ports": ["127.0.0.1:1"], "registered": [{"uid": os.getuid()}]}
        conn.sendall(json.dumps(reply).encode() + b"\\n"); conn.close()
answerer = threading.Thread(target=answer, daemon=True); answerer.start()
from agentsandbox import doctor, run
from agentsandbox.config import loads
from agentsandbox.paths import Paths
config = loads(b"", "<test>", Paths.fromEnvironment())
env = {"AGENTSANDBOX_DISPATCH_SOCKET": path, "HOME": os.environ["HOME"]}
involved, problem = run.dispatcherDiagnosis(config, env)
check = doctor.checkDispatcher(config, env, None)
answerer.join()
print(json.dumps({
    "involved": involved, "problem": problem and problem.what, "check": check.detail, "asked": [a.decode() for a in asked],
    "twisted": sorted(m for m in sys.modules if m.split(".")[0] == "twisted"),
}))
"""


def test_run_and_doctor_ask_a_dispatcher_without_importing_twisted(tmp_path: Path) -> None:
    # Before the wire left dispatch.py, this query imported 45 Twisted modules.
    path = str(tmp_path / "dispatch.sock")
    result = subprocess.run(
        [sys.executable, "-c", _RUN_AND_DOCTOR, path], env=pythonEnv(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    # Both asked, and both read the answer: the stand-in serves a port that is not proxy.port.
    assert seen["asked"] == ['{"op":"status"}\n'] * 2
    assert seen["involved"] is True
    assert "serves 127.0.0.1:1, not proxy.port" in seen["problem"]
    assert "serves 127.0.0.1:1, not proxy.port" in seen["check"]
    assert seen["twisted"] == []
