"""agentsandbox: one policy for AI coding agents, enforced in four places."""

__version__ = "0.1.0"

#: The one-line purpose: the README's first sentence, `--help` and every man page open with it.
PURPOSE = (
    "Run AI coding agents on your machine without them reading your secrets, "
    "reaching hosts off an allow list, or holding a credential."
)
