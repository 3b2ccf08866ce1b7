"""The broker's config keys, including the ``caller_env`` key this issue added."""

from __future__ import annotations

import os

import pytest

from agentsandbox.config import ConfigError
from tests.support.broker_support import makeConfig


def _run(**command: object) -> dict[str, object]:
    return {"run": {"up": {"argv": ["/bin/true"], **command}}}


def test_runCommandKeys(tmp_path: os.PathLike[str]) -> None:
    config = makeConfig(str(tmp_path), _run(args=["[a-z]+"], env=["PATH"], caller_env=["CLAUDE_CODE_SESSION_ID"]))
    command = config.broker.command("up")
    assert command is not None
    assert command.caller_env == ("CLAUDE_CODE_SESSION_ID",)
    assert command.env == ("PATH",)
    assert makeConfig(str(tmp_path), _run()).broker.command("up").caller_env == ()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("command", "key", "why"),
    [
        ({"caller_env": "X"}, "broker.run.up.caller_env", "list of strings"),
        ({"caller_env": ["1X"]}, "broker.run.up.caller_env[0]", "not a variable name"),
        ({"caller_env": ["LD_PRELOAD"]}, "broker.run.up.caller_env[0]", "would steer the host program"),
        ({"caller_env": ["OK", "PATH"]}, "broker.run.up.caller_env[1]", "would steer the host program"),
        ({"caller_env": ["GIT_SSH_COMMAND"]}, "broker.run.up.caller_env[0]", "would steer"),
        ({"env": ["A-B"]}, "broker.run.up.env[0]", "not a variable name"),
        ({"args": ["("]}, "broker.run.up.args[0]", "not a regular expression"),
        ({"argv": ["true"]}, "broker.run.up.argv[0]", "absolute path"),
        ({"timeout": 0}, "broker.run.up.timeout", "greater than zero"),
        ({"stream": "yes"}, "broker.run.up.stream", "true or false"),
        ({"typo": 1}, "broker.run.up.typo", "unknown key"),
    ],
)
def test_badRunCommands(command: dict[str, object], key: str, why: str, tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        makeConfig(str(tmp_path), _run(**command))
    assert caught.value.key == key
    assert why in caught.value.why
