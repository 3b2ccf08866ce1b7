"""The registry of requests held for a person's answer (issue 28), driven by a Clock, no sockets."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock

from agentsandbox.approvals import Answer
from agentsandbox.config import Config
from agentsandbox.configedit import HEADER, ConfigEditError, addEntry
from agentsandbox.egress.approvals import ApprovalRegistry, Outcome, configWriter
from agentsandbox.loader import load
from tests.conftest import REPO, User

ASKING = '[proxy]\nunlisted = "ask"\nask_timeout = 30\nmax_held = 3\n'


class World:
    def __init__(self, user: User, text: str = ASKING) -> None:
        self.user = user
        user.writeConfig(text)
        self.config: Config = load(None, user.env)
        self.clock = Clock()
        self.records: list[tuple[str, dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.registry = ApprovalRegistry(
            lambda: self.config, self.clock, lambda event, **f: self.records.append((event, f)),
            configWriter(lambda: self.config),
        )
        self.registry.subscribe(self.events.append)

    def ask(self, host: str = "example.org", port: int = 443, kind: str = "connect") -> list[Outcome]:
        got: list[Outcome] = []
        self.registry.ask(host, port, kind, "127.0.0.1:40000", "1234 curl").addCallback(got.append)
        return got

    def reload(self) -> None:
        self.config = load(None, self.user.env)


@pytest.fixture
def world(user: User) -> World:
    return World(user)


def test_a_held_request_waits_until_answered_once_and_the_next_is_asked_again(world: World) -> None:
    got = world.ask()
    assert got == [] and [r.host for r in world.registry.held] == ["example.org"]
    assert world.events[0]["event"] == "held" and world.events[0]["request"]["process"] == "1234 curl"
    by = "command line: pid 42 uid 1000"
    assert world.registry.answer("example.org", Answer("allow", "once", by=by)) == ["1"]
    assert got == [Outcome(True, "allowed")] and world.registry.held == []
    event, fields = world.records[-1]
    assert event == "decided" and fields["by"] == by and fields["verdict"] == "allow" and fields["scope"] == "once"
    assert world.events[-1]["event"] == "decided" and world.events[-1]["answer"]["by"] == by
    again = world.ask()
    assert again == [] and len(world.registry.held) == 1  # once means this request only
    snapshot = world.registry.snapshot()
    assert snapshot["mode"] == "ask" and [h["id"] for h in snapshot["held"]] == ["2"]
    assert [r["outcome"] for r in snapshot["recent"]] == ["allowed"]


def test_nobody_answering_refuses_after_ask_timeout_with_words_saying_so(world: World) -> None:
    got = world.ask("example.org", 8443)
    world.clock.advance(29.9)
    assert got == []
    world.clock.advance(0.1)
    assert got[0].allowed is False and got[0].how == "timedout"
    assert "nobody answered within proxy.ask_timeout (30s)" in got[0].text
    assert "`agentsandbox approve example.org`" in got[0].text and "'example.org:8443'" in got[0].text
    assert world.records[-1] == ("timedout", {**world.records[-1][1], "reason": got[0].text})
    assert world.events[-1]["event"] == "timedout"
    assert world.registry.snapshot()["recent"][-1]["outcome"] == "timedout"


def test_deny_once_refuses_naming_who_and_what_to_do(world: World) -> None:
    got = world.ask()
    world.registry.answer("1", Answer("deny", "once", by="watch: pid 7 uid 1000"))
    assert got[0].allowed is False and got[0].how == "denied"
    assert "the person refused it (deny once, by watch: pid 7 uid 1000" in got[0].text
    assert "sandbox.domains" in got[0].text and "`agentsandbox approve example.org`" in got[0].text


def test_for_a_while_decides_what_follows_until_it_ends(world: World) -> None:
    first, second = world.ask(), world.ask(port=80)
    assert world.registry.answer("Example.ORG.", Answer("allow", "for", 600, by="cli")) == ["1", "2"]
    assert first[0].allowed and second[0].allowed
    assert world.ask() == [Outcome(True, "remembered")]
    world.clock.advance(600)
    assert world.ask() == []  # asked again once the while is over


def test_for_until_the_service_stops_and_taken_with_nothing_held(world: World) -> None:
    assert world.registry.answer("example.org", Answer("deny", "for", None, by="cli")) == []
    refused = world.ask()
    assert refused[0].allowed is False and refused[0].how == "remembered"
    world.registry.stop()
    assert world.ask() == []


def test_once_with_nothing_held_or_an_unknown_id_is_an_error_in_words(world: World) -> None:
    with pytest.raises(ValueError, match=r"no request for example\.org is waiting"):
        world.registry.answer("example.org", Answer("allow", "once"))
    with pytest.raises(ValueError, match="neither a waiting request's id nor a host name"):
        world.registry.answer("not a host!", Answer("allow", "once"))


def test_more_than_max_held_is_refused_at_once_saying_so(world: World) -> None:
    for _ in range(3):
        world.ask()
    over = world.ask("example.net")
    assert over[0].allowed is False and over[0].how == "full"
    assert "3 requests already wait" in over[0].text and "proxy.max_held" in over[0].text


def test_a_client_that_goes_away_withdraws_its_request(world: World) -> None:
    d = world.registry.ask("example.org", 443, "socks", "127.0.0.1:1", None)
    d.addErrback(lambda f: None)
    d.cancel()
    assert world.registry.held == [] and world.events[-1]["event"] == "withdrawn"
    world.clock.advance(60)  # no timer left behind


def test_always_writes_the_users_file_keeping_comments_and_the_defaults(world: World, user: User) -> None:
    user.writeConfig("# my notes\n[sandbox]\n# projects\nwrite = []\n\n" + ASKING)
    os.chmod(user.configFile, 0o600)
    world.reload()
    got = world.ask("example.org", 443)
    world.registry.answer("example.org", Answer("allow", "always", by="cli"))
    assert got[0].allowed
    text = user.configFile.read_text()
    assert text.startswith("# my notes\n[sandbox]\n# projects\nwrite = []\n")
    assert 'domains = ["github.com", "*.github.com", "*.githubusercontent.com", "example.org"]' in text
    assert stat.S_IMODE(os.stat(user.configFile).st_mode) == 0o600
    world.reload()  # what the watcher does
    assert "example.org" in world.config.sandbox.domains
    world.registry.answer("bad.example.com", Answer("deny", "always", by="cli"))
    world.reload()
    assert world.config.sandbox.refused_domains == ("bad.example.com",)


def test_always_creates_the_users_file_with_a_header(user: User, tmp_path: Path) -> None:
    path = tmp_path / "conf" / "agentsandbox" / "config.toml"
    assert addEntry(str(path), "sandbox", "domains", "example.org", ("github.com",))
    text = path.read_text()
    assert text.startswith("# " + HEADER.splitlines()[0])
    assert 'domains = ["github.com", "example.org"]' in text
    assert not addEntry(str(path), "sandbox", "domains", "example.org")


def test_never_under_etc_and_a_broken_file_is_left_alone(tmp_path: Path) -> None:
    with pytest.raises(ConfigEditError, match="under /etc"):
        addEntry("/etc/agentsandbox/config.toml", "sandbox", "domains", "example.org")
    broken = tmp_path / "c.toml"
    broken.write_text("[sandbox\n")
    with pytest.raises(ConfigEditError, match="not TOML, so it was left alone"):
        addEntry(str(broken), "sandbox", "domains", "example.org")
    assert broken.read_text() == "[sandbox\n"


def test_an_always_that_cannot_be_written_answers_nothing(world: World, user: User) -> None:
    user.configFile.write_text("[sandbox\n")
    got = world.ask()
    with pytest.raises(ValueError, match=r"sandbox\.domains was not written, so nothing was answered"):
        world.registry.answer("example.org", Answer("allow", "always", by="cli"))
    assert got == [] and len(world.registry.held) == 1


def test_a_multi_line_list_stays_one_entry_a_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[sandbox]\ndomains = [\n  "github.com",  # for gh\n]\n')
    addEntry(str(path), "sandbox", "domains", "example.org")
    lines = path.read_text().splitlines()
    assert lines[2] == '  "github.com",  # for gh' and lines[3].strip() == '"example.org",'


def test_the_answering_commands_import_no_twisted(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from agentsandbox.cli import main; rc = main(['approve', 'example.org', '--for', '10m']);"
        "print(rc, [m for m in sys.modules if m.startswith('twisted')])"
    )
    env = {"PATH": os.environ["PATH"], "XDG_RUNTIME_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout == "1 []\n"
    assert done.stderr == (
        f"agentsandbox approve: no control socket at {tmp_path}/agentsandbox/control.sock: the agentsandbox "
        "service is not running (start it: systemctl --user start agentsandbox, or agentsandbox serve)\n"
    )


def test_an_always_the_config_would_refuse_is_not_written(world: World, user: User) -> None:
    before = user.configFile.read_text()
    with pytest.raises(ValueError, match=r"would open every loopback port"):
        world.registry.answer("localhost", Answer("allow", "always", by="cli"))
    assert user.configFile.read_text() == before
    with pytest.raises(ValueError, match=r"no request 7 is waiting"):
        world.registry.answer("7", Answer("allow", "always", by="cli"))


def test_the_journal_and_log_say_each_approvals_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agentsandbox.audit import AuditLog, journalLine, logMain

    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), journal=False)
    base = {"kind": "connect", "client": "127.0.0.1:5", "host": "example.org", "port": 443, "id": "3"}
    lines = [
        journalLine(audit.record("held", **base, reason="held for the person's answer (up to 90s, proxy.ask_timeout)")),
        journalLine(audit.record("decided", **base, by="agentsandbox approve (pid 9 sh, uid 1)", verdict="allow",
                                 scope="for", seconds=600.0, reason="allowed")),
        journalLine(audit.record("decided", **base, by="watch", verdict="deny", scope="once", reason="no")),
        journalLine(audit.record("timedout", **base, reason="nobody answered")),
        journalLine(audit.record("control", client="pid 9 uid 1", reason="the answer was not taken: x")),
    ]
    audit.close()
    assert lines == [
        "approvals: holding connect example.org:443 from 127.0.0.1:5 (request 3): held for the person's answer "
        "(up to 90s, proxy.ask_timeout)",
        "approvals: allow for 600s example.org:443 (request 3) by agentsandbox approve (pid 9 sh, uid 1)",
        "approvals: deny once example.org:443 (request 3) by watch",
        "approvals: nobody answered for example.org:443 (request 3): nobody answered",
        "approvals: refused a control request from pid 9 uid 1: the answer was not taken: x",
    ]
    assert logMain(["--file", str(path), "--denied"]) == 0
    assert capsys.readouterr().out.count("approvals: ") == 3


def test_the_starter_config_explains_ask(user: User) -> None:
    from agentsandbox.loader import loads
    from agentsandbox.paths import Paths
    from agentsandbox.setup import starterConfig

    text = starterConfig(False)
    assert '# unlisted = "refuse"' in text and "agentsandbox approvals / approve HOST / deny HOST" in text
    assert "# refused_domains = []" in text
    config = loads(text.replace('# unlisted = "refuse"', 'unlisted = "ask"').encode(), "starter", Paths.fromEnvironment(user.env))
    assert config.proxy.unlisted == "ask" and config.proxy.ask_timeout == 90.0
