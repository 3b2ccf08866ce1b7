"""``egress/privates.py``: the fast paths through Twisted's private parts, and the switch back.

With ``AGENTSANDBOX_TWISTED_PRIVATES=0`` the proxy uses Twisted's public API
alone; a child pytest runs the proxy's legs that way (a CONNECT tunnel, SOCKS5,
a forwarded request, a terminated exchange with a pooled upstream, a direct
dial, a half-close, a connection handed over by the dispatcher).  The rest of
the suite runs them with the switch on, where they behave as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from agentsandbox.egress import privates
from tests.conftest import REPO
from tests.support.broker_support import pythonEnv

#: The proxy's legs, run with the switch off.  Not the zero-copy test: with
#: the switch off there is no splice(2).
_LEGS = [
    "tests/test_privates.py::test_this_run_has_the_switch_its_environment_says",
    "tests/test_nodelay.py::NoDelayTests::test_connectTunnelBothLegs",
    "tests/test_nodelay.py::NoDelayTests::test_socks5BothLegs",
    "tests/test_nodelay.py::NoDelayTests::test_forwardBothLegs",
    "tests/test_nodelay.py::NoDelayTests::test_terminatedClientAndPooledUpstream",
    "tests/test_nodelay.py::NoDelayTests::test_handedOverByTheDispatcher",
    "tests/test_dial.py",
    "tests/test_egress_halfclose.py::HalfCloseTests::test_halfCloseAfterOneAbsoluteFormRequest",
    "tests/test_inject_proxy.py::ThroughTheProxy::test_curlConnect",
    "tests/test_inject_proxy.py::ThroughTheProxy::test_theTerminatedTunnelsRecordCountsBothWays",
]


def test_this_run_has_the_switch_its_environment_says() -> None:
    off = os.environ.get(privates.SWITCH) == "0"
    assert privates.ENABLED is not off
    assert (privates.writeNow is privates._write) is off
    assert (privates.shutWrite is privates._loseWriteConnection) is off


def test_the_switch_off_chooses_the_public_calls_once() -> None:
    code = (
        "import json\n"
        "from twisted.internet import reactor\n"
        "from agentsandbox.egress import dial, privates, splice\n"
        "print(json.dumps({'enabled': privates.ENABLED, 'writeNow': privates.writeNow.__name__,\n"
        "    'shutWrite': privates.shutWrite.__name__, 'zeroCopy': splice.zeroCopyAvailable(),\n"
        "    'connectsItself': dial.tcpDialer(reactor).connectsItself}))\n"
    )
    chosen = {}
    for value in ("0", "1"):
        result = subprocess.run(
            [sys.executable, "-c", code], env=pythonEnv({privates.SWITCH: value}), capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        chosen[value] = json.loads(result.stdout)
    assert chosen["0"] == {
        "enabled": False, "writeNow": "_write", "shutWrite": "_loseWriteConnection", "zeroCopy": False, "connectsItself": False,
    }  # fmt: skip
    assert chosen["1"]["enabled"] is True
    assert (chosen["1"]["writeNow"], chosen["1"]["shutWrite"], chosen["1"]["connectsItself"]) == ("_writeNow", "_shutWrite", True)


def test_the_proxy_works_with_the_switch_off() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *_LEGS],
        env=pythonEnv({privates.SWITCH: "0"}),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # Every leg ran: none was deselected or skipped.
    assert " passed" in result.stdout
    assert "skipped" not in result.stdout and "deselected" not in result.stdout
