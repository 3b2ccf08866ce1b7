"""The decision log: fields, rotation, journal lines, and `agentsandbox log` / `suggest`."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from agentsandbox import cli
from agentsandbox.audit import AuditLog, journalLine, parseDuration, readRecords, suggestions


def clockAt(t: list[float]) -> Callable[[], float]:
    return lambda: t[0]


def test_recordKeepsOnlyDecisionFields(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "a" / "audit.jsonl"), journal=False, wallClock=lambda: 100.0)
    log.record(
        "refused",
        kind="connect",
        client="127.0.0.1:5",
        host="example.net",
        port=443,
        reason="not listed",
        allow="example.net",
        headers={"Authorization": "token ghu_secret"},
        body=b"ghu_secret",
        token="ghu_secret",
        path="/?access_token=ghu_secret",
    )
    log.close()
    text = (tmp_path / "a" / "audit.jsonl").read_text()
    assert "ghu_secret" not in text and "Authorization" not in text
    assert json.loads(text) == {
        "ts": 100.0, "event": "refused", "kind": "connect", "client": "127.0.0.1:5",
        "host": "example.net", "port": 443, "reason": "not listed", "allow": "example.net",
        "path": "/",  # a path is kept without its query string unless audit.queries says so
    }
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "audit.jsonl").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700
    with pytest.raises(ValueError):
        log.record("whatever")


def test_queriesAreKeptOnlyWhenConfigured(tmp_path: Path) -> None:
    kept = AuditLog(str(tmp_path / "q.jsonl"), journal=False, queries=True)
    assert kept.record("refused", path="/a?page=2")["path"] == "/a?page=2"
    kept.close()
    dropped = AuditLog(str(tmp_path / "d.jsonl"), journal=False)
    assert dropped.record("withheld", method="GET", path="/a?token=x")["path"] == "/a"
    dropped.close()


def test_rotation(tmp_path: Path) -> None:
    path = str(tmp_path / "audit.jsonl")
    log = AuditLog(path, maxBytes=400, keep=2, journal=False)
    for i in range(40):
        log.record("tunnel", host=f"h{i}.example.org", port=443, up=i, down=i)
    log.close()
    assert os.path.getsize(path) <= 400
    assert os.path.exists(path + ".1") and os.path.exists(path + ".2") and not os.path.exists(path + ".3")
    hosts = [r["host"] for r in readRecords(path)]
    assert hosts == sorted(hosts, key=lambda h: int(h[1:].split(".")[0]))  # oldest first, across files
    assert hosts[-1] == "h39.example.org"


def test_unwritableAuditKeepsGoing(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    log = AuditLog(str(tmp_path / "file" / "audit.jsonl"), journal=False)
    assert log.record("peer", client="x", reason="r")["event"] == "peer"


def test_journalLines() -> None:
    assert journalLine({"event": "refused", "kind": "socks", "host": "a", "port": 1, "client": "c", "reason": "why"}) == "egress: refused socks a:1 from c: why"
    assert "10 bytes up, 20 down" in journalLine({"event": "tunnel", "kind": "connect", "host": "a", "port": 1, "up": 10, "down": 20, "duration": 1.5})
    assert journalLine({"event": "peer", "client": "c", "reason": "uid"}) == "egress: refused a connection from c: uid"


def test_journalGoesThroughTwistedLogger(tmp_path: Path) -> None:
    from twisted.logger import ILogObserver, globalLogPublisher

    seen: list[dict[str, Any]] = []
    # Any callable observes; the stubs ask for the interface.
    observer = cast(ILogObserver, seen.append)
    globalLogPublisher.addObserver(observer)
    try:
        AuditLog(str(tmp_path / "a.jsonl")).record("refused", kind="connect", host="example.net", port=443, reason="r")
    finally:
        globalLogPublisher.removeObserver(observer)
    assert any(e.get("line", "").startswith("egress: refused connect example.net:443") for e in seen)


@pytest.mark.parametrize("text,seconds", [("90", 90), ("30s", 30), ("10m", 600), ("2h", 7200), ("7d", 604800), ("1w", 604800), ("1.5h", 5400)])
def test_parseDuration(text: str, seconds: float) -> None:
    assert parseDuration(text) == seconds


@pytest.mark.parametrize("bad", ["", "ten", "5y", "-1h", "1h2m"])
def test_parseDurationRefuses(bad: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parseDuration(bad)


def fill(path: str, now: list[float]) -> None:
    log = AuditLog(path, journal=False, wallClock=lambda: now[0])
    now[0] = 1000.0
    log.record("tunnel", kind="connect", host="ok.example.org", port=443, up=1, down=2, duration=0.5)
    log.record("refused", kind="connect", host="old.example.net", port=443, reason="not listed", allow="old.example.net")
    now[0] = 5000.0
    for _ in range(3):
        log.record("refused", kind="socks", host="new.example.net", port=443, reason="not listed", allow="new.example.net")
    log.record("refused", kind="connect", host="db.example.org", port=5432, reason="resolves to 10.0.0.1", allow="10.0.0.1:5432", address="10.0.0.1")
    log.record("peer", client="127.0.0.1:9", reason="uid 4242")
    log.close()


def test_logCommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "audit.jsonl")
    fill(path, [0.0])
    assert cli.main(["log", "--file", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7 and lines[0].startswith("1970-01-01T00:16:40Z egress: connect ok.example.org:443")
    assert cli.main(["log", "--file", path, "--denied", "--json"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {r["event"] for r in recs} == {"refused", "peer"} and len(recs) == 6

    from agentsandbox.audit import logMain

    assert logMain(["--file", path, "--since", "1h"], now=lambda: 5100.0) == 0
    out = capsys.readouterr().out
    assert "old.example.net" not in out and "new.example.net" in out
    with pytest.raises(SystemExit):
        logMain(["--file", path, "--since", "soon"])
    assert "not a duration" in capsys.readouterr().err


def test_suggestCommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "audit.jsonl")
    fill(path, [0.0])
    from agentsandbox.audit import suggestMain

    assert suggestMain(["--file", path, "--since", "1h"], now=lambda: 5100.0) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# add to [sandbox] domains")
    assert out[1] == "  # example.net"
    assert out[2].split("#")[0].strip() == '"new.example.net",' and "refused 3x, last 1970-01-01T01:23:20Z" in out[2]
    assert out[3] == "  # 10.0.0.1"
    assert out[4].split("#")[0].strip() == '"10.0.0.1:5432",'
    assert all("old.example.net" not in line for line in out)
    assert suggestMain(["--file", path], now=lambda: 10**9) == 0
    assert "no refusals" in capsys.readouterr().err
    found = suggestions(readRecords(path), None)
    assert found["old.example.net"].count == 1


def test_logReadsTheConfiguredFile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.toml"
    audit = tmp_path / "state" / "a.jsonl"
    cfg.write_text(f'[audit]\nfile = "{audit}"\n')
    fill(str(audit), [0.0])
    assert cli.main(["log", "--config", str(cfg), "--denied"]) == 0
    assert "new.example.net" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[audit]\nmax_bytes = -1\n")
    with pytest.raises(SystemExit) as exited:
        cli.main(["log", "--config", str(bad)])
    assert exited.value.code == cli.EXIT_CONFIG
    assert "audit.max_bytes" in capsys.readouterr().err


def test_recordLinesAreWhatTheStandardEncoderWrites(tmp_path: Path) -> None:
    """The reused C encoder writes byte for byte what json.dumps(ensure_ascii, compact) would."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), journal=False, wallClock=lambda: 1234.5678)
    fields = {
        "kind": "connect",
        "client": "[::1]:5",
        "host": "bücher.example.org\n\"\\\t\x00",
        "port": 443,
        "reason": "ünicode \u2028 and \U0001f600",
        "up": 0,
        "down": 2**40,
        "duration": 0.1,
        "via": True,
        "address": float("inf"),
    }
    rec = log.record("tunnel", **fields)
    log.close()
    line = path.read_text(encoding="ascii")
    assert line == json.dumps(rec, ensure_ascii=True, separators=(",", ":")) + "\n"
    assert json.loads(line) == rec


def test_suggest_turns_observations_into_grouped_counted_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Observe mode's "would refuse" records become allow-list lines, grouped by domain, deduplicated."""
    import tomllib

    from agentsandbox.audit import suggestMain

    path = str(tmp_path / "audit.jsonl")
    log = AuditLog(path, journal=False, wallClock=lambda: 5000.0)
    for host, port, times in (("a.example.com", 443, 4), ("b.example.com", 443, 1), ("example.org", 8443, 2),
                              ("a.example.com", 443, 0)):  # fmt: skip
        for _ in range(times):
            log.record("observed", kind="connect", host=host, port=port, reason=f"{host} is not on the allow list",
                       allow=host if port == 443 else f"{host}:{port}")  # fmt: skip
    log.record("refused", kind="connect", host="b.example.com", port=443, reason="not listed", allow="b.example.com")
    log.close()
    assert suggestMain(["--file", path], now=lambda: 5001.0) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1:] == [
        "  # example.com",
        '  "a.example.com",     # would refuse 4x (observed), last 1970-01-01T01:23:20Z',
        '  "b.example.com",     # refused 1x, would refuse 1x (observed), last 1970-01-01T01:23:20Z',
        "  # example.org",
        '  "example.org:8443",  # would refuse 2x (observed), last 1970-01-01T01:23:20Z',
    ]
    # Ready to paste: the lines are a TOML array's body.
    body = "\n".join(line.split("#")[0] for line in lines[1:])
    assert tomllib.loads(f"domains = [\n{body}\n]")["domains"] == ["a.example.com", "b.example.com", "example.org:8443"]
    assert "OBSERVED connect a.example.com:443" in journalLine(next(readRecords(path)))
