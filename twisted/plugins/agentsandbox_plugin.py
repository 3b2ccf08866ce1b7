# No __init__.py in twisted/ or twisted/plugins/: Twisted's own package extends
# its plugin path over every twisted/plugins directory on sys.path.
from twisted.application.service import ServiceMaker

agentsandbox = ServiceMaker(
    "agentsandbox",
    "agentsandbox.tap",
    "The agentsandbox egress proxy, broker, token keepers and config watcher.",
    "agentsandbox",
)
