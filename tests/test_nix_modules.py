"""The Nix modules, evaluated offline against real nixpkgs lib and home-manager trees.

``nix/tests/eval-nixos.nix`` and ``nix/tests/eval-hm.nix`` evaluate the modules
(the NixOS one with ``lib.evalModules`` and stand-in NixOS declarations, the
home-manager one inside home-manager's real module set) and print JSON.  Here
that JSON is checked against the package itself:

- the config file each module generates is written as TOML and loaded by the
  real loader (``agentsandbox.config``);
- the drop-in the NixOS module installs comes from ``nix/dropin.nix``; its
  build script, as the module instantiated it, is run with this checkout's
  console scripts where the package's store path stands, and its output must
  equal ``agentsandbox render claude --config`` of the machine's file as each
  user runs it (a user's own config never reaches it), naming the package's
  ``agentsandbox-policy-helper``;
- the home-manager module installs no drop-in and builds nothing bound for
  /etc from the user's settings: its activation checks the machine's drop-in
  names a policy helper and otherwise prints ``sudo …/agentsandbox install``;
  its config file is built by running the package's loader on it;
- the units must carry every directive of the units shipped in
  agentsandbox/data/, with store paths only where the contract allows;
- every refusal the modules assert must be a refusal of the loader, with the
  loader's own words.

The trees come from ``$AGENTSANDBOX_THIRD_PARTY`` or ``../shared/third_party``;
without them the module skips, saying so.  With them, a missing nix-instantiate
fails: CI installs nix-bin.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentsandbox.config import ConfigError
from agentsandbox.loader import loads
from agentsandbox.paths import Paths

REPO = Path(__file__).resolve().parent.parent
THIRD_PARTY = Path(os.environ.get("AGENTSANDBOX_THIRD_PARTY") or REPO.parent / "shared" / "third_party")
LIB_TREE = THIRD_PARTY / "nixpkgs-lib"
HM_TREE = THIRD_PARTY / "home-manager"

# No daemon, no build users, no binary cache: evaluation only.
NIX_CONFIG = "build-users-group =\nsubstituters =\nexperimental-features = nix-command flakes\n"

if not (LIB_TREE / "lib" / "default.nix").exists() or not (HM_TREE / "modules" / "modules.nix").exists():
    pytest.skip(
        f"no nixpkgs lib and home-manager trees at {THIRD_PARTY} (set AGENTSANDBOX_THIRD_PARTY)",
        allow_module_level=True,
    )

ALICE_HOME = "/home/alice"


def _nixInstantiate() -> str:
    found = shutil.which("nix-instantiate")
    if found is None:
        pytest.fail("nix-instantiate is not installed (apt-get install nix-bin): the module evaluations cannot run")
    return found


def _run(harness: str, config: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [
        _nixInstantiate(),
        "--eval",
        "--strict",
        "--json",
        "--read-write-mode",
        str(REPO / "nix" / "tests" / harness),
        "--arg",
        "libTree",
        str(LIB_TREE),
        "--argstr",
        "configJSON",
        json.dumps(config),
        *extra,
    ]
    if harness == "eval-hm.nix":
        argv += ["--arg", "hmTree", str(HM_TREE)]
    env = dict(os.environ, NIX_CONFIG=NIX_CONFIG)
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)


def evaluate(harness: str, config: dict[str, Any], *extra: str) -> dict[str, Any]:
    p = _run(harness, config, *extra)
    assert p.returncode == 0, p.stderr
    result: dict[str, Any] = json.loads(p.stdout)
    return result


def evaluationError(harness: str, config: dict[str, Any]) -> str:
    p = _run(harness, config)
    assert p.returncode != 0, f"evaluation succeeded: {p.stdout[:500]}"
    return p.stderr


def nixos(config: dict[str, Any]) -> dict[str, Any]:
    return evaluate("eval-nixos.nix", {"enable": True, **config})


def hm(config: dict[str, Any], *extra: str) -> dict[str, Any]:
    return evaluate("eval-hm.nix", {"enable": True, **config}, *extra)


# --------------------------------------------------------------------------- TOML


def _tomlValue(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_tomlValue(x) for x in v) + "]"
    raise TypeError(f"not a TOML scalar or array: {v!r}")


def _tomlKey(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def toTOML(data: dict[str, Any], prefix: str = "") -> str:
    """What nixpkgs' formats.toml writes, for the values the modules produce."""
    lines: list[str] = []
    tail: list[str] = []
    for k, v in data.items():
        key = prefix + _tomlKey(k)
        if isinstance(v, dict):
            tail.append(f"[{key}]\n" + toTOML(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                tail.append(f"[[{key}]]\n" + toTOML(item, key + "."))
        else:
            lines.append(f"{_tomlKey(k)} = {_tomlValue(v)}")
    return "\n".join(lines) + ("\n" if lines else "") + "\n".join(tail)


def writeTOML(path: Path, value: dict[str, Any]) -> Path:
    text = toTOML(value)
    assert tomllib.loads(text) == value, text  # the writer itself is checked
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- the package


def consoleScripts() -> dict[str, str]:
    """pyproject.toml's console scripts, ``name -> module:function``: what the package's bin/ has."""
    scripts: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts


class Package:
    """This checkout standing where the package's store path was: a bin/ with every console script."""

    def __init__(self, root: Path) -> None:
        self.root = root
        bindir = root / "bin"
        bindir.mkdir(parents=True)
        for name, entry in consoleScripts().items():
            module, _, function = entry.partition(":")
            script = bindir / name
            code = f"import sys; from {module} import {function}; sys.exit({function}())"
            script.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -c "{code}" "$@"\n')
            script.chmod(0o755)

    @property
    def exe(self) -> str:
        return str(self.root / "bin" / "agentsandbox")

    @property
    def helper(self) -> str:
        return str(self.root / "bin" / "agentsandbox-policy-helper")


@pytest.fixture
def package(tmp_path: Path) -> Package:
    return Package(tmp_path / "package")


def runBuilder(
    script: str, subst: dict[str, str], work: Path, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a runCommand's script as Nix would: clean env, $out, $TMPDIR (and its env attributes)."""
    for old, new in subst.items():
        assert old in script, (old, script)
        script = script.replace(old, new)
    build = work / "build"
    build.mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(build), "out": str(work / "out"), "HOME": "/homeless-shelter", **(extra or {})}
    return subprocess.run(["bash", "-euc", script], env=env, capture_output=True, text=True, timeout=120, check=False)


def runDropInScript(script: str, subst: dict[str, str], work: Path) -> bytes:
    p = runBuilder(script, subst, work)
    assert p.returncode == 0, p.stderr
    return (work / "out").read_bytes()


def renderAsUser(package: Package, home: Path, config: Path | None) -> bytes:
    """``agentsandbox render claude`` the way the user's own session runs it."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "XDG_RUNTIME_DIR": "/run/user/1000",
        "AGENTSANDBOX_EXE": package.exe,
    }
    argv = [package.exe, "render", "claude"] + (["--config", str(config)] if config else [])
    p = subprocess.run(argv, env=env, capture_output=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    return p.stdout


def loaderError(value: dict[str, Any], home: str = ALICE_HOME) -> str | None:
    """The loader's ``KEY: WHY`` for a config, or None when it loads."""
    raw = toTOML(value).encode()
    paths = Paths.fromEnvironment({"HOME": home, "XDG_RUNTIME_DIR": "/run/user/1000"})
    try:
        loads(raw, f"{home}/.config/agentsandbox/config.toml", paths)
    except ConfigError as e:
        return f"{e.key}: {e.why}" if e.key else e.why
    return None


# --------------------------------------------------------------------------- shipped units


def shippedUnit(name: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in (REPO / "agentsandbox" / "data" / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def asList(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]


def substituted(value: str, pkg: str, coreutils: str) -> str:
    return (
        value.replace("/usr/bin/", f"{pkg}/bin/")
        .replace("/bin/kill ", f"{coreutils}/bin/kill ")
        .replace("file:///usr/share/doc/agentsandbox/", f"file://{pkg}/share/doc/agentsandbox/")
    )


SETTINGS: dict[str, Any] = {
    "sandbox": {
        "write": ["~/src"],
        "read": ["~/.cache/go-build"],
        "deny": ["~/src/app/.env.d"],
        "domains": ["github.com", "*.github.com", "registry.example.org", "127.0.0.1:6443"],
    },
    "broker": {"run": {"cluster-up": {"argv": ["/usr/local/bin/kind", "create", "cluster"], "args": ["^--name=[a-z0-9-]+$"]}}},
}


# A user's own config, wider (a domain, a write path) and narrower than SETTINGS.
ALICE_OWN: dict[str, Any] = {
    "sandbox": {"write": ["~/alice-only"], "domains": ["github.com", "alice.example.org"], "deny": ["~/src/secret"]},
}


# =========================================================================== NixOS


@pytest.fixture(scope="module")
def nixosEval() -> dict[str, Any]:
    return nixos({"users": ["alice", "bob"], "settings": SETTINGS})


def test_nixos_writes_the_settings_to_etc_and_the_loader_takes_them(nixosEval: dict[str, Any], tmp_path: Path) -> None:
    entry = nixosEval["etc"]["agentsandbox/config.toml"]["source"]
    value = entry["value"]
    # Unset keys stay out of the file (the loader's defaults apply); proxy.port is the contract's.
    assert value == {**SETTINGS, "proxy": {"port": 3190}}
    assert loaderError(value) is None
    assert nixosEval["failedAssertions"] == []
    assert nixosEval["warnings"] == []
    assert nixosEval["systemPackages"] == [nixosEval["package"]]
    assert nixosEval["etc"]["claude-code/managed-settings.json"]["text"] == "{}\n"
    print(f"checked: /etc/agentsandbox/config.toml = {json.dumps(value, sort_keys=True)}")


def test_nixos_dropin_is_what_the_renderer_gives_every_user(
    nixosEval: dict[str, Any], package: Package, tmp_path: Path
) -> None:
    config = nixosEval["etc"]["agentsandbox/config.toml"]["source"]
    dropIn = nixosEval["etc"]["claude-code/managed-settings.d/50-agentsandbox.json"]["source"]
    toml = writeTOML(tmp_path / "etc" / "config.toml", config["value"])
    script = dropIn["script"]
    pkg = nixosEval["package"]
    # The module hands the package's renderer the very file it installs in /etc, and nothing else.
    assert f"{pkg}/bin/agentsandbox render claude --config {config['path']} > \"$out\"" in script
    assert f"AGENTSANDBOX_EXE={pkg}/bin/agentsandbox" in script
    built = runDropInScript(script, {pkg: str(package.root), config["path"]: str(toml)}, tmp_path)
    for user in ("alice", "bob"):
        home = tmp_path / "home" / user
        assert built == renderAsUser(package, home, toml), user
    # A user's own config never reaches the machine's drop-in: alice's, wider
    # and narrower than the machine's, renders the same file.
    alice = tmp_path / "home" / "alice"
    writeTOML(alice / ".config" / "agentsandbox" / "config.toml", ALICE_OWN)
    assert built == renderAsUser(package, alice, toml)
    for leaked in ("alice.example.org", "~/alice-only"):
        assert leaked not in built.decode()
    settings = json.loads(built)
    # It names the package's policy helper, which gives each session its user's own policy.
    assert settings["policyHelper"] == {"path": package.helper}
    assert json.loads(built.decode().replace(str(package.root), pkg))["policyHelper"] == {
        "path": f"{pkg}/bin/agentsandbox-policy-helper"
    }
    assert "agentsandbox-policy-helper" in consoleScripts() and os.access(package.helper, os.X_OK)
    assert settings["sandbox"]["network"]["allowedDomains"] == SETTINGS["sandbox"]["domains"]
    # PreToolUse: the package's interpreter on its hookstart.py, handed the package's command.
    pre = settings["hooks"]["PreToolUse"][0]["hooks"][0]
    assert pre["command"] == sys.executable
    assert pre["args"] == ["-I", "-S", str(REPO / "agentsandbox" / "hookstart.py"), package.exe, "pretooluse"]
    assert settings["hooks"]["SessionStart"][0]["hooks"][0]["command"] == package.exe
    print(
        f"checked: the NixOS drop-in ({len(built)} bytes) equals `agentsandbox render claude --config` of its /etc file "
        f"for alice (with and without her own config) and bob, and names {pkg}/bin/agentsandbox-policy-helper"
    )


def test_nixos_dispatcher_units_mirror_the_shipped_ones(nixosEval: dict[str, Any]) -> None:
    pkg, coreutils = nixosEval["package"], nixosEval["coreutils"]
    service = nixosEval["services"]["agentsandbox-dispatch"]
    shipped = shippedUnit("agentsandbox-dispatch.service")
    for key, values in shipped["Service"].items():
        if key == "Environment":
            assert service["environment"] == dict(v.split("=", 1) for v in values)
            continue
        assert asList(service["serviceConfig"][key]) == [substituted(v, pkg, coreutils) for v in values], key
    assert set(service["serviceConfig"]) == set(shipped["Service"]) - {"Environment"}
    assert service["serviceConfig"]["ExecStart"] == f"{pkg}/bin/agentsandbox dispatch"
    assert service["requires"] == shipped["Unit"]["Requires"] and service["after"] == shipped["Unit"]["After"]
    assert service["wantedBy"] == []  # started by its socket only

    socket = nixosEval["sockets"]["agentsandbox-dispatch"]
    shippedSocket = shippedUnit("agentsandbox-dispatch.socket")
    assert socket["listenStreams"] == shippedSocket["Socket"]["ListenStream"]
    for key, values in shippedSocket["Socket"].items():
        if key != "ListenStream":
            assert asList(socket["socketConfig"][key]) == values, key
    assert socket["wantedBy"] == ["sockets.target"]
    print(f"checked: agentsandbox-dispatch.service ({len(shipped['Service'])} directives) and .socket mirror agentsandbox/data/")


def test_nixos_dispatcher_follows_the_port_and_socket_settings() -> None:
    result = nixos({"settings": {"proxy": {"port": 4100, "dispatch_socket": "/run/as/d.sock"}}})
    assert result["sockets"]["agentsandbox-dispatch"]["listenStreams"] == ["127.0.0.1:4100", "[::1]:4100", "/run/as/d.sock"]
    off = nixos({"dispatcher": {"enable": False}})
    assert off["sockets"] == {} and off["services"] == {}
    print("checked: proxy.port and proxy.dispatch_socket move the socket unit's listeners; dispatcher.enable = false drops both units")


def test_nixos_dispatch_root_reaches_the_dispatchers_config() -> None:
    """The dispatcher reads proxy.dispatch_root from /etc/agentsandbox/config.toml: the module writes it there."""
    result = nixos({"settings": {"proxy": {"dispatch_root": True}}})
    value = result["etc"]["agentsandbox/config.toml"]["source"]["value"]
    assert value["proxy"] == {"port": 3190, "dispatch_root": True}
    assert loaderError(value) is None
    assert result["failedAssertions"] == [] and result["warnings"] == []
    unset = nixos({})["etc"]["agentsandbox/config.toml"]["source"]["value"]
    assert "dispatch_root" not in unset.get("proxy", {})
    print("checked: settings.proxy.dispatch_root = true is written to /etc/agentsandbox/config.toml and loads; unset, it is left out (the loader's false)")


def test_nixos_user_unit_for_every_user_or_the_listed_ones(nixosEval: dict[str, Any]) -> None:
    pkg, coreutils = nixosEval["package"], nixosEval["coreutils"]
    unit = nixosEval["userServices"]["agentsandbox"]
    shipped = shippedUnit("agentsandbox.service")
    for key, values in shipped["Service"].items():
        if key != "Environment":
            assert asList(unit["serviceConfig"][key]) == [substituted(v, pkg, coreutils) for v in values], key
    assert unit["serviceConfig"]["ExecStart"] == f"{pkg}/bin/agentsandbox-twistd --nodaemon --pidfile= --logfile=- agentsandbox"
    assert unit["serviceConfig"]["ExecReload"] == f"{coreutils}/bin/kill -HUP $MAINPID"
    assert unit["wantedBy"] == ["default.target"]
    assert unit["unitConfig"]["ConditionUser"] == ["|alice", "|bob"]
    assert unit["environment"]["PYTHONUNBUFFERED"] == "1"
    path = unit["environment"]["PATH"].split(":")
    assert any(p.endswith("-git-0/bin") for p in path) and "/etc/profiles/per-user/%u/bin" in path
    everyone = nixos({})["userServices"]["agentsandbox"]
    assert "ConditionUser" not in everyone["unitConfig"]
    print("checked: user unit ExecStart, ExecReload, ConditionUser=|alice |bob (none without users), PATH")


def test_nixos_git_signing_points_at_the_wrappers() -> None:
    result = nixos({"gitSigning": True})
    pkg = result["package"]
    assert result["git"]["enable"] is True
    assert result["git"]["config"]["gpg"] == {
        "program": f"{pkg}/bin/agentsandbox-gpg",
        "ssh": {"program": f"{pkg}/bin/agentsandbox-ssh-sign"},
    }
    assert nixos({})["git"]["config"] == {}


# Each bad setting, and the loader's words for it.  The NixOS module knows no
# home (the file serves every user), so its messages keep paths as ~/…; the
# home-manager module expands them as the loader does.
BAD: list[tuple[str, dict[str, Any]]] = [
    ("write inside read", {"sandbox": {"read": ["~/src"], "write": ["~/src/app"]}}),
    ("write inside an implicit read", {"sandbox": {"write": ["~/.claude/projects/x"]}}),
    ("every host", {"sandbox": {"domains": ["*"]}}),
    ("every host on a port", {"sandbox": {"domains": ["*:443"]}}),
    ("inner wildcard", {"sandbox": {"domains": ["api.*.example.com"]}}),
    ("two wildcards", {"sandbox": {"domains": ["*.*.example.com"]}}),
    ("loopback without a port", {"sandbox": {"domains": ["localhost"]}}),
    ("every localhost name", {"sandbox": {"domains": ["*.localhost"]}}),
    ("IPv6 loopback", {"sandbox": {"domains": ["[::1]"]}}),
    ("the proxy itself", {"sandbox": {"domains": ["127.0.0.1:3190"]}}),
    ("port zero", {"sandbox": {"domains": ["registry.example.org:0"]}}),
    ("port too large", {"sandbox": {"domains": ["registry.example.org:70000"]}}),
    ("a port with a leading zero", {"sandbox": {"domains": ["registry.example.org:0443"]}}),
    ("a signed port", {"sandbox": {"domains": ["registry.example.org:+443"]}}),
    ("a relative path", {"sandbox": {"write": ["src"]}}),
    ("an inject rule without a token", {"inject": [{"hosts": ["registry.example.org"]}]}),
    ("a host command by a relative name", {"broker": {"run": {"up": {"argv": ["kind"]}}}}),
]


@pytest.mark.parametrize(("what", "settings"), BAD, ids=[w for w, _ in BAD])
def test_nixos_asserts_what_the_loader_refuses(what: str, settings: dict[str, Any]) -> None:
    expected = loaderError(settings)
    assert expected is not None, f"the loader takes {settings}"
    failed = nixos({"settings": settings})["failedAssertions"]
    assert len(failed) == 1, failed
    message = failed[0]
    prefix = "services.agentsandbox.settings: "
    assert message.startswith(prefix) and message.endswith(" (agentsandbox's config loader refuses this)")
    assert message[len(prefix) :].split(" (agentsandbox")[0] == expected.replace(ALICE_HOME, "~")
    print(f"checked: NixOS assertion for {what}: {message}")


def test_nixos_accepts_what_the_loader_accepts() -> None:
    # Broad but legal: the loader takes *.com, so the module does too.
    for settings in ({"sandbox": {"domains": ["*.com", "127.0.0.1:6443", "[::1]:8080"]}}, {"sandbox": {"read": ["~/src"], "write": ["~/work"]}}):
        assert loaderError(settings) is None
        assert nixos({"settings": settings})["failedAssertions"] == []


def test_nixos_dispatcher_without_registration_is_refused() -> None:
    failed = nixos({"settings": {"proxy": {"dispatch_socket": ""}}})["failedAssertions"]
    assert failed == [
        'services.agentsandbox: the dispatcher is enabled but settings.proxy.dispatch_socket is "", so no user\'s service would register with it; drop the setting or set dispatcher.enable = false'
    ]
    assert nixos({"dispatcher": {"enable": False}, "settings": {"proxy": {"dispatch_socket": ""}}})["failedAssertions"] == []


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"proxy": {"port": "3190"}}, "services.agentsandbox.settings.proxy.port' is not of type `integer between 1 and 65535"),
        ({"proxy": {"port": 0}}, "services.agentsandbox.settings.proxy.port' is not of type `integer between 1 and 65535"),
        ({"sandbox": {"domains": "github.com"}}, "services.agentsandbox.settings.sandbox.domains' is not of type `null or (list of string)"),
        ({"proxy": {"dispatch_root": "yes"}}, "services.agentsandbox.settings.proxy.dispatch_root' is not of type `null or boolean"),
    ],
)
def test_nixos_mistyped_setting_fails_with_the_option_named(settings: dict[str, Any], needle: str) -> None:
    error = evaluationError("eval-nixos.nix", {"enable": True, "settings": settings})
    assert needle in error, error
    print(f"checked: NixOS type error: {needle}")


def test_nixos_request_rules_are_typed_keys() -> None:
    """[[inject.requests]], [github] and audit.queries are options of their own, not freeform."""
    rule = {"action": "refuse", "methods": ["POST"], "path": "/gists"}
    for settings in (
        {"inject": [{"hosts": ["api.example.com"], "token_env": "T", "unmatched": "refuse", "requests": [rule]}]},
        {"github": {"unmatched": "allow", "requests": [dict(rule, host="api.github.com")], "repos": ["o/r", "team/*"],
                    "mutations": ["addStar"]}, "audit": {"queries": True}, "proxy": {"require_session": True}},
    ):
        result = nixos({"settings": settings})
        assert result["warnings"] == [] and result["failedAssertions"] == [], result
        assert loaderError(settings) is None
    error = evaluationError("eval-nixos.nix", {"enable": True, "settings": {"github": {"requests": [dict(rule, action="deny")]}}})
    assert "deny" in error, error
    print("checked: request rules are typed options; an action other than allow/refuse fails evaluation")


def test_nixos_unknown_key_warns() -> None:
    warnings = nixos({"settings": {"sandbox": {"domain": ["github.com"]}}})["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("services.agentsandbox.settings.sandbox.domain is not a key")


# =========================================================================== home-manager


@pytest.fixture(scope="module")
def hmEval() -> dict[str, Any]:
    return hm({"settings": SETTINGS, "git": {"signing": True}})


def test_hm_config_file_and_unit(hmEval: dict[str, Any]) -> None:
    pkg, coreutils = hmEval["package"], hmEval["coreutils"]
    entry = hmEval["configFile"]["agentsandbox/config.toml"]
    assert entry["target"] == ".config/agentsandbox/config.toml"
    value = entry["source"]["env"]["generated"]["value"]
    # No proxy.port unless set: it is the machine's where /etc has a config.
    assert value == SETTINGS
    assert loaderError(value) is None
    assert hmEval["failedAssertions"] == []
    assert hmEval["homePackages"] == [pkg]

    service = hmEval["service"]
    assert service["Service"]["ExecStart"] == [f"{pkg}/bin/agentsandbox-twistd --nodaemon --pidfile= --logfile=- agentsandbox"]
    assert service["Install"] == {"WantedBy": ["default.target"]}
    assert service["Unit"]["X-Restart-Triggers"] == [entry["source"]["path"]]
    # The unit file home-manager writes carries every shipped directive.
    unitText = hmEval["unitFile"]
    shipped = shippedUnit("agentsandbox.service")
    for section, keys in shipped.items():
        assert f"[{section}]" in unitText
        for key, values in keys.items():
            for v in values:
                assert f"\n{key}={substituted(v, pkg, coreutils)}\n" in unitText, (key, v)
    assert re.search(r"\nEnvironment=PATH=[^\n]*-git-0/bin:[^\n]*-gh-0/bin:/home/alice/\.nix-profile/bin:", unitText)
    print("checked: ~/.config/agentsandbox/config.toml, systemd.user.services.agentsandbox and the unit file home-manager writes")


def runHmConfigBuild(hmEval: dict[str, Any], package: Package, work: Path) -> subprocess.CompletedProcess[str]:
    """The config file's build (the package's loader run on it), with ``package`` standing in."""
    source = hmEval["configFile"]["agentsandbox/config.toml"]["source"]
    generated = writeTOML(work / "store" / "agentsandbox-config.toml", source["env"]["generated"]["value"])
    return runBuilder(source["script"], {hmEval["package"]: str(package.root)}, work, {"generated": str(generated)})


def test_hm_config_file_is_built_by_the_packages_loader(hmEval: dict[str, Any], package: Package, tmp_path: Path) -> None:
    source = hmEval["configFile"]["agentsandbox/config.toml"]["source"]
    assert f"{hmEval['package']}/bin/agentsandbox config --config \"$generated\" > /dev/null" in source["script"]
    p = runHmConfigBuild(hmEval, package, tmp_path / "good")
    assert p.returncode == 0, p.stderr
    assert tomllib.loads((tmp_path / "good" / "out").read_text()) == source["env"]["generated"]["value"]
    # What the module leaves to the loader (a regular expression) fails the
    # build with the loader's words, not Claude Code's next start.
    bad = {"broker": {"run": {"up": {"argv": ["/usr/bin/true"], "args": ["("]}}}}
    expected = loaderError(bad)
    assert expected is not None
    refused = hm({"settings": bad})
    assert refused["failedAssertions"] == []
    p = runHmConfigBuild(refused, package, tmp_path / "bad")
    assert p.returncode == 2 and expected in p.stderr, p.stderr
    assert not (tmp_path / "bad" / "out").exists()
    print(f"checked: home-manager's config file is the loader's to build: {p.stderr.strip()}")


def test_hm_renders_no_dropin_and_sends_nothing_of_the_users_to_etc(hmEval: dict[str, Any]) -> None:
    """The machine's drop-in is root's, from the machine's config: nothing here is built from the user's for /etc."""
    assert hmEval["dataFile"] == {}
    source = hmEval["configFile"]["agentsandbox/config.toml"]["source"]
    userPaths = (source["path"], source["env"]["generated"]["path"])
    # The user's config (either store file) is named only by the file home-manager links and the unit's restart trigger.
    rest = {k: v for k, v in hmEval.items() if k not in ("configFile", "service", "unitFile")}
    rest["service"] = {**hmEval["service"], "Unit": {k: v for k, v in hmEval["service"]["Unit"].items() if k != "X-Restart-Triggers"}}
    text = json.dumps(rest)
    for path in userPaths:
        assert path not in text, path
    script = hmEval["activation"]
    for value in ("registry.example.org", "cluster-up", "~/src"):
        assert value not in script
    # The activation reads /etc and writes nothing: no copy, no install, no redirection.
    for line in script.splitlines():
        assert not re.search(r"\b(cp|install|tee|ln|mv)\s|>\s*/etc", line.replace("agentsandbox install", "")), line
    print("checked: no home-manager output renders a drop-in or names the user's config outside ~/.config and the unit")


HM_DROPIN = "/etc/claude-code/managed-settings.d/50-agentsandbox.json"
HM_BASE = "/etc/claude-code/managed-settings.json"


def runActivation(hmEval: dict[str, Any], package: Package, managed: Path) -> subprocess.CompletedProcess[str]:
    """The activation step with ``managed`` standing for /etc/claude-code and a real jq for the store's."""
    jq = shutil.which("jq")
    if jq is None:
        pytest.skip("jq is not installed (home-manager's activation has it)")
    script = hmEval["activation"].replace("/etc/claude-code/", f"{managed}/")
    script = script.replace(f"{hmEval['jq']}/bin/jq", jq).replace(hmEval["package"], str(package.root))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(managed.parent / "home")}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_hm_activation_prints_the_one_root_command(hmEval: dict[str, Any]) -> None:
    script = hmEval["activation"]
    assert hmEval["activationAfter"] == ["linkGeneration"]
    command = f"sudo {hmEval['package']}/bin/agentsandbox install"
    assert re.findall(r"sudo [^\"]*", script) == [command]
    assert f"{hmEval['jq']}/bin/jq -er '.policyHelper.path | strings' {HM_DROPIN}" in script
    print(f"checked: the activation's one root command is `{command}`")


def test_hm_activation_asks_root_for_the_machines_dropin_until_one_names_a_helper(
    hmEval: dict[str, Any], package: Package, tmp_path: Path
) -> None:
    managed = tmp_path / "claude-code"
    dropDir = managed / "managed-settings.d"
    command = f"sudo {package.exe} install"
    own = hmEval["configFile"]["agentsandbox/config.toml"]["target"]

    def says(why: str) -> None:
        p = runActivation(hmEval, package, managed)
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        assert [line for line in lines if "sudo " in line] == [f"  {command}"], p.stdout
        assert why in lines[0], p.stdout
        assert "never from your file" in lines[0] and f"/home/alice/{own}" in lines[2], p.stdout

    says(f"{dropDir}/50-agentsandbox.json is not installed")
    dropDir.mkdir(parents=True)
    # A drop-in from before the helper (or anyone else's): hooks, no policyHelper.
    (dropDir / "50-agentsandbox.json").write_text(json.dumps({"hooks": {}, "sandbox": {"enabled": True}}))
    says("names no policy helper")
    (dropDir / "50-agentsandbox.json").write_text("not json")
    says("names no policy helper")
    # One whose helper's store path is gone.
    gone = "/nix/store/00000000000000000000000000000000-agentsandbox-0.0.1/bin/agentsandbox-policy-helper"
    (dropDir / "50-agentsandbox.json").write_text(json.dumps({"policyHelper": {"path": gone}}))
    says(f"names the policy helper {gone}, which is not there")

    # The printed command, run as root would (here: the test's own managed
    # dir), renders the machine's drop-in; after it the activation is silent.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "root"), "AGENTSANDBOX_EXE": package.exe}
    p = subprocess.run([package.exe, "install", "--managed-dir", str(managed)], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    installed = json.loads((dropDir / "50-agentsandbox.json").read_text())
    assert installed["policyHelper"] == {"path": package.helper}
    assert (managed / "managed-settings.json").read_text() == "{}\n"
    quiet = runActivation(hmEval, package, managed)
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout + quiet.stderr

    # Without the base file Claude Code reads no drop-in.
    (managed / "managed-settings.json").unlink()
    says(f"{managed}/managed-settings.json is missing")
    print(f"checked: the activation prints `{command}` until /etc/claude-code has a drop-in naming a helper that exists, then nothing")


def test_hm_activation_is_silent_with_the_nixos_modules_dropin(
    hmEval: dict[str, Any], nixosEval: dict[str, Any], package: Package, tmp_path: Path
) -> None:
    """On NixOS with the NixOS module, whose drop-in names the system package's helper, the user is not asked for root."""
    config = nixosEval["etc"]["agentsandbox/config.toml"]["source"]
    toml = writeTOML(tmp_path / "etc" / "config.toml", config["value"])
    system = Package(tmp_path / "system-package")
    built = runDropInScript(
        nixosEval["etc"]["claude-code/managed-settings.d/50-agentsandbox.json"]["source"]["script"],
        {nixosEval["package"]: str(system.root), config["path"]: str(toml)},
        tmp_path,
    )
    managed = tmp_path / "claude-code"
    (managed / "managed-settings.d").mkdir(parents=True)
    (managed / "managed-settings.d" / "50-agentsandbox.json").write_bytes(built)
    (managed / "managed-settings.json").write_text(nixosEval["etc"]["claude-code/managed-settings.json"]["text"])
    p = runActivation(hmEval, package, managed)
    assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr


def test_hm_git_signing(hmEval: dict[str, Any]) -> None:
    pkg = hmEval["package"]
    assert hmEval["git"] == {"program": f"{pkg}/bin/agentsandbox-gpg", "ssh": {"program": f"{pkg}/bin/agentsandbox-ssh-sign"}}
    assert hmEval["warnings"] == [
        "services.agentsandbox.git.signing sets programs.git's config, which has no effect while programs.git.enable is false"
    ]
    assert hm({})["git"] is None


def test_hm_is_linux_only() -> None:
    failed = hm({}, "--argstr", "system", "x86_64-darwin")["failedAssertions"]
    assert len(failed) == 1 and "The module services.agentsandbox does not support your platform" in failed[0], failed
    print(f"checked: home-manager Linux-only assertion: {failed[0].splitlines()[0]}")


@pytest.mark.parametrize(("what", "settings"), BAD, ids=[w for w, _ in BAD])
def test_hm_asserts_the_loaders_own_words(what: str, settings: dict[str, Any]) -> None:
    expected = loaderError(settings)
    failed = hm({"settings": settings})["failedAssertions"]
    assert failed == [f"services.agentsandbox.settings: {expected} (agentsandbox's config loader refuses this)"]


def test_hm_leaves_the_port_to_the_machine(tmp_path: Path) -> None:
    """A user's file names no proxy.port unless they set one: under a machine config it is the machine's alone."""
    from agentsandbox.loader import load

    user = hm({"settings": {"sandbox": {"write": ["~/src"]}}})["configFile"]["agentsandbox/config.toml"]
    value = user["source"]["env"]["generated"]["value"]
    assert "proxy" not in value
    home = tmp_path / "home" / "alice"
    writeTOML(home / ".config" / "agentsandbox" / "config.toml", value)
    machine = writeTOML(tmp_path / "etc" / "config.toml", nixos({"settings": {"proxy": {"port": 4100}, "sandbox": {"write": ["~/src"]}}})["etc"]["agentsandbox/config.toml"]["source"]["value"])
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": "/run/user/1000"}
    effective = load(None, env, str(machine))
    assert effective.proxy.port == 4100 and effective.notices == ()
    # Set, it is written, and a machine with another port leaves it out with a notice.
    own = hm({"settings": {"proxy": {"port": 3190}}})["configFile"]["agentsandbox/config.toml"]["source"]
    assert own["env"]["generated"]["value"] == {"proxy": {"port": 3190}}
    writeTOML(home / ".config" / "agentsandbox" / "config.toml", own["env"]["generated"]["value"])
    effective = load(None, env, str(machine))
    assert effective.proxy.port == 4100 and len(effective.notices) == 1 and "proxy.port = 3190" in effective.notices[0]
    error = evaluationError("eval-hm.nix", {"enable": True, "settings": {"proxy": {"port": 0}}})
    assert "services.agentsandbox.settings.proxy.port' is not of type `null or integer between 1 and 65535" in error, error
    print("checked: home-manager writes proxy.port only when set; under a machine config at 4100 the user's file loads without a notice")


def test_hm_mistyped_setting_fails_with_the_option_named() -> None:
    error = evaluationError("eval-hm.nix", {"enable": True, "settings": {"sandbox": {"write": "~/src"}}})
    assert "services.agentsandbox.settings.sandbox.write' is not of type `null or (list of string)" in error, error


def test_hm_unknown_option_fails() -> None:
    error = evaluationError("eval-hm.nix", {"enable": True, "setings": {}})
    assert "The option `services.agentsandbox.setings' does not exist" in error, error


@pytest.fixture(autouse=True)
def _noStrayEnvironment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The renderer reads these; the tests give it exactly what a user has.
    for name in ("AGENTSANDBOX_CONFIG", "AGENTSANDBOX_EXE", "CLAUDE_CONFIG_DIR", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    yield


def test_allow_tools_enum_is_the_tables() -> None:
    """The module's `allow_tools` type names exactly the tools the drop-in removes."""
    from agentsandbox.tools import reopenable

    text = (REPO / "nix" / "settings.nix").read_text()
    found = re.search(r"allow_tools = opt \(types\.listOf \(types\.enum \[([^\]]*)\]\)\)", text)
    assert found is not None, "nix/settings.nix declares no allow_tools enum"
    assert re.findall(r'"([^"]+)"', found.group(1)) == reopenable()
    evaluated = nixos({"settings": {"sandbox": {"allow_tools": ["Workflow"]}}})
    value = evaluated["etc"]["agentsandbox/config.toml"]["source"]["value"]
    assert value["sandbox"]["allow_tools"] == ["Workflow"]
    assert loaderError(value) is None and evaluated["warnings"] == []
    error = evaluationError("eval-nixos.nix", {"enable": True, "settings": {"sandbox": {"allow_tools": ["Read"]}}})
    assert "allow_tools" in error, error


def test_package_has_the_policy_helper_the_dropins_name() -> None:
    """The drop-in names ``bin/agentsandbox-policy-helper`` beside ``bin/agentsandbox``: the package lays it down.

    The package cannot be built here (no package tree offline): this checks
    the name is a console script (buildPythonApplication wraps each, with
    AGENTSANDBOX_EXE) and that nix/package.nix fails its build without it.
    """
    from agentsandbox.claude import HELPER_NAME

    assert consoleScripts()[HELPER_NAME] == "agentsandbox.policyhelper:main"
    text = (REPO / "nix" / "package.nix").read_text()
    assert f"test -x $out/bin/{HELPER_NAME} ||" in text
    assert '"agentsandbox.policyhelper"' in text  # pythonImportsCheck
    assert re.search(r'"--set-default"\s+"AGENTSANDBOX_EXE"\s+"\$\{placeholder "out"\}/bin/agentsandbox"', text)
