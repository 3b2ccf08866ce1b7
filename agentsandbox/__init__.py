"""agentsandbox: one policy for AI coding agents, enforced in four places."""

__version__ = "0.1.0"
