"""A freedesktop notification server for tests: owns org.freedesktop.Notifications on a real bus.

Run by Debian's ``/usr/bin/python3`` (python3-gi's Gio.DBus), on the session bus
the test's own ``dbus-daemon --session`` serves::

    DBUS_SESSION_BUS_ADDRESS=... /usr/bin/python3 -m tests.support.notifications

It speaks the Desktop Notifications Specification 1.2 (Notify, CloseNotification,
GetCapabilities, GetServerInformation; ActionInvoked and NotificationClosed) and
reports on stdout, one JSON object a line:

- ``{"ready": NAME}`` once it owns the name;
- ``{"notify": {"id", "sender", "summary", "body", "actions", "hints", "expire"}}``;
- ``{"closed": ID, "reason": N}`` whenever a notification goes (3: closed by a call).

Its stdin takes what a person's click would do: ``invoke ID KEY`` (ActionInvoked,
then the notification closes, reason 2, as servers do) and ``dismiss ID``.

Its signals go to the notification's sender only (a unicast signal), as KDE
Plasma's server sends them: a client that watches the bus from another
connection (``gdbus monitor``) never sees them, so the notifier must hear them
on the connection that called Notify.  Servers that broadcast them (dunst,
GNOME Shell) are served by the same design.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from gi.repository import Gio, GLib  # type: ignore[import-not-found,import-untyped,unused-ignore]

NAME = "org.freedesktop.Notifications"
PATH = "/org/freedesktop/Notifications"
XML = """
<node>
  <interface name="org.freedesktop.Notifications">
    <method name="GetCapabilities"><arg type="as" direction="out"/></method>
    <method name="Notify">
      <arg type="s" direction="in"/><arg type="u" direction="in"/><arg type="s" direction="in"/>
      <arg type="s" direction="in"/><arg type="s" direction="in"/><arg type="as" direction="in"/>
      <arg type="a{sv}" direction="in"/><arg type="i" direction="in"/><arg type="u" direction="out"/>
    </method>
    <method name="CloseNotification"><arg type="u" direction="in"/></method>
    <method name="GetServerInformation">
      <arg type="s" direction="out"/><arg type="s" direction="out"/>
      <arg type="s" direction="out"/><arg type="s" direction="out"/>
    </method>
    <signal name="NotificationClosed"><arg type="u"/><arg type="u"/></signal>
    <signal name="ActionInvoked"><arg type="u"/><arg type="s"/></signal>
  </interface>
</node>
"""


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message, sort_keys=True) + "\n")
    sys.stdout.flush()


class Server:
    def __init__(self) -> None:
        self.next = 1
        self.senders: dict[int, str] = {}
        self.connection: Any = None
        self.pending = b""

    def call(self, conn: Any, sender: str, path: str, iface: str, method: str, params: Any, invocation: Any) -> None:
        if method == "GetCapabilities":
            invocation.return_value(GLib.Variant("(as)", (["actions", "body"],)))
        elif method == "GetServerInformation":
            invocation.return_value(GLib.Variant("(ssss)", ("agentsandbox-test", "agentsandbox", "1", "1.2")))
        elif method == "Notify":
            app, replaces, _icon, summary, body, actions, hints, expire = params.unpack()
            nid = replaces or self.next
            self.next += 1
            self.senders[nid] = sender
            # The reply first, then the report: a click the test sends on the report
            # must reach the client after it has learnt its notification's id (a
            # signal for an id it does not know yet is dropped, as by any client).
            invocation.return_value(GLib.Variant("(u)", (nid,)))
            say({"notify": {"id": nid, "sender": sender, "app": app, "summary": summary, "body": body,
                            "actions": actions, "hints": {k: str(v) for k, v in hints.items()}, "expire": expire}})  # fmt: skip
        elif method == "CloseNotification":
            (nid,) = params.unpack()
            invocation.return_value(None)
            self.close(nid, 3)

    def signal(self, nid: int, name: str, args: Any) -> None:
        sender = self.senders.get(nid)
        if sender is not None:
            self.connection.emit_signal(sender, PATH, NAME, name, args)

    def close(self, nid: int, reason: int) -> None:
        if nid in self.senders:
            self.signal(nid, "NotificationClosed", GLib.Variant("(uu)", (nid, reason)))
            del self.senders[nid]
            say({"closed": nid, "reason": reason})

    def command(self, channel: Any, condition: Any) -> bool:
        # os.read, not sys.stdin: a buffered reader would keep a second line
        # where the main loop's watch never sees it.
        data = os.read(sys.stdin.fileno(), 4096)
        if not data:
            loop.quit()
            return False
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            self.run(line.decode().split())
        return True

    def run(self, words: list[str]) -> None:
        if words[:1] == ["invoke"] and len(words) == 3:
            nid = int(words[1])
            self.signal(nid, "ActionInvoked", GLib.Variant("(us)", (nid, words[2])))
            self.close(nid, 2)
        elif words[:1] == ["dismiss"] and len(words) == 2:
            self.close(int(words[1]), 2)


server = Server()
loop = GLib.MainLoop()


def main() -> None:
    bus = Gio.bus_get_sync(Gio.BusType.SESSION, None)
    server.connection = bus
    info = Gio.DBusNodeInfo.new_for_xml(XML)
    bus.register_object(PATH, info.interfaces[0], server.call, None, None)

    def acquired(conn: Any, name: str) -> None:
        say({"ready": name})

    def lost(conn: Any, name: str) -> None:
        say({"lost": name})
        loop.quit()

    Gio.bus_own_name_on_connection(bus, NAME, Gio.BusNameOwnerFlags.NONE, acquired, lost)
    GLib.io_add_watch(GLib.IOChannel.unix_new(sys.stdin.fileno()), GLib.IO_IN | GLib.IO_HUP, server.command)
    loop.run()


if __name__ == "__main__":
    main()
