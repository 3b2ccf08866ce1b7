"""Settings for Anthropic's sandbox runtime (``srt``), rendered from the same policy.

``agentsandbox run -- CMD`` holds any agent (not only Claude Code) to the
policy: srt's bubblewrap gets the same filesystem lists as the drop-in, and its
network goes through our egress proxy (``httpProxyPort``/``socksProxyPort``), so
the allow list, the address rules and the injection apply unchanged.  srt
settings are per user and per run, so paths are written absolute.
"""

from __future__ import annotations

import json
from typing import Any

from agentsandbox.policy import Policy


def render(policy: Policy) -> dict[str, Any]:
    closed = list(policy.closed())
    return {
        "filesystem": {
            "allowRead": [p for p in policy.read if any(_under(p, c) for c in closed)],
            "allowWrite": list(policy.write),
            "denyRead": closed + list(policy.deny),
            "denyWrite": [*policy.deny, policy.harness],
        },
        "network": {
            "allowedDomains": list(policy.domains),
            "deniedDomains": [],
            "httpProxyPort": policy.proxyPort,
            "socksProxyPort": policy.proxyPort,
        },
    }


def _under(path: str, directory: str) -> bool:
    from agentsandbox.policy import under

    return under(path, directory)


def dumps(settings: dict[str, Any]) -> str:
    return json.dumps(settings, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
