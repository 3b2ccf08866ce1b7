"""twistd glue: ``twistd -n agentsandbox [--config FILE]`` and the plugin-free runner.

``agentsandbox-twistd`` behaves exactly like ``twistd`` (same flags, same
``--help``) but knows only our service maker, so it never scans or writes the
plugin cache: an install in a read-only location (the Nix store,
``/usr/lib/python3/dist-packages`` for another user) never warns about it.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from twisted.application.service import IService, ServiceMaker
from twisted.python import usage

from agentsandbox import __version__


class Options(usage.Options):
    synopsis = "[--config FILE]"
    longdesc = (
        "Run the agentsandbox service: the egress proxy, the broker, the token keepers, "
        "the config watcher and the audit log, in one reactor."
    )
    optParameters: ClassVar[list[list[Any]]] = [
        ["config", "c", None, "config file (default: $AGENTSANDBOX_CONFIG, the user's, the system's, built-in)"],
    ]

    def opt_version(self) -> None:
        print(f"agentsandbox {__version__}")
        sys.exit(0)


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    from agentsandbox.config import ConfigError
    from agentsandbox.loader import load
    from agentsandbox.service import freezeStartupHeap
    from agentsandbox.service import makeService as make

    try:
        config = load(options["config"])
    except ConfigError as e:
        raise usage.UsageError(str(e)) from None
    # The explicit --config, or None for the usual lookup, which each reload runs again.
    service = make(config, reactor=reactor, configPath=options["config"])
    # A proxy that cannot listen stops the process (the service has said why),
    # so systemd's Restart=on-failure and the journal see it, rather than a
    # half-running service.
    service.listening.addErrback(lambda _: reactor.callWhenRunning(reactor.stop))
    reactor.callWhenRunning(freezeStartupHeap)
    _made.append(service)
    return service


#: The services this process made, so the runner can exit non-zero when one failed to start.
_made: list[Any] = []


serviceMaker = ServiceMaker(
    "agentsandbox",
    "agentsandbox.tap",
    "The agentsandbox egress proxy, broker, token keepers and config watcher.",
    "agentsandbox",
)


def runTwistd(argv: list[str] | None = None) -> None:
    """``agentsandbox-twistd``: twistd that knows only our service maker."""
    from twisted.application import app
    from twisted.scripts import twistd

    class ServerOptions(twistd.ServerOptions):  # type: ignore[name-defined,misc]
        @staticmethod
        def _getPlugins(interface: Any) -> list[ServiceMaker]:
            return [serviceMaker]

    from twisted.python import usage

    from agentsandbox.cli import EXIT_CONFIG

    if argv is not None:
        sys.argv[1:] = argv
    try:
        app.run(twistd.runApp, ServerOptions)
    except usage.UsageError as e:
        # makeService refused the config: said once, with the status of every
        # command's config error, not as a traceback.
        print(f"agentsandbox-twistd: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    # The reason is in the log already (twistd owns stderr by now).
    if any(s.startFailure for s in _made):
        sys.exit(1)
