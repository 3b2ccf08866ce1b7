"""Loading the config in force: the machine's file, the user's held to it, the layout checked.

``config.py`` owns the file's grammar and values (``parse``: TOML in, a frozen
``Config`` out); this module composes what a loaded config must also pass,
which needs the floors above the grammar: ``machine.narrow`` (a user's file only
narrows the machine's) and the policy's layout check (``Policy.nestedError``: a
writable path bubblewrap would mount read-only).  Living above both, it lets
``config.py`` import neither, so the package has no import circle.

Stdlib only: the hook loads the config on every file-tool call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

from agentsandbox.config import (
    BUILTIN,
    Config,
    ConfigError,
    builtinRules,
    locate,
    machineConfig,
    parse,
    readConfig,
    sameFile,
    toml,
)
from agentsandbox.config import loads as parseFile
from agentsandbox.paths import Paths
from agentsandbox.policy import Policy


def checkLayout(config: Config) -> Config:
    """``config``, unless the sandbox cannot mount its layout (``Policy.nestedError``): ConfigError."""
    why = Policy.fromConfig(config).nestedError()
    if why is not None:
        raise ConfigError(config.source, "sandbox.write", why)
    return config


def loads(raw: bytes, source: str, paths: Paths) -> Config:
    """A config file's bytes, parsed and its layout checked."""
    return checkLayout(parseFile(raw, source, paths))


def load(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    machine: str | None = None,
) -> Config:
    """Find, read and validate the config in force for this user.  Raises ConfigError.

    With a machine config (``machine``, default ``/etc/agentsandbox/config.toml``
    when it exists) the user's file only narrows it (``machine.narrow``).
    The machine's file is never taken from the environment: a user must not
    be able to swap the admin's bounds for a file of their own.
    """
    env = os.environ if environ is None else environ
    paths = Paths.fromEnvironment(env)
    userPath = locate(explicit, env)
    machinePath = machine if machine is not None else machineConfig()
    if machinePath is not None and userPath is not None and sameFile(machinePath, userPath):
        userPath = None
    if machinePath is None:
        if userPath is None:
            return checkLayout(parse({}, BUILTIN, paths))
        return loads(readConfig(userPath), userPath, paths)
    machineConfigValue = loads(readConfig(machinePath), machinePath, paths)
    machineConfigValue = replace(machineConfigValue, machine=machinePath)
    if userPath is None:
        return machineConfigValue
    data = toml(readConfig(userPath), userPath)
    user = checkLayout(parse(data, userPath, paths))
    # Only a machine with its own file pays for the narrowing's imports (the hook
    # loads the config on every file-tool call).
    from agentsandbox.machine import narrow

    config = narrow(machineConfigValue, user, data)
    if config.inject_builtin:
        # The built-in GitHub rule follows the narrowed allow list, as it follows a file's own.
        config = replace(config, inject=builtinRules(config.sandbox.allowList, config.inject))
    checkLayout(config)
    return config


def loadMachine(environ: Mapping[str, str] | None = None, path: str | None = None) -> Config:
    """The machine's config alone, as ``environ``'s user reads it (``~`` is their home).

    ``path``, else ``/etc/agentsandbox/config.toml``, else the built-in
    defaults.  What the machine's drop-in and the dispatcher are made from.
    """
    paths = Paths.fromEnvironment(os.environ if environ is None else environ)
    path = path or machineConfig()
    if path is None:
        return checkLayout(parse({}, BUILTIN, paths))
    return replace(loads(readConfig(path), path, paths), machine=path)
