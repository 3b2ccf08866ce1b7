"""Repository tooling shared by the tests and the benchmarks (never installed).

The test doubles of the package's seams ship in ``agentsandbox.egress.testing``;
what lives here drives the checkout itself (the service as a child process),
so that ``bench/`` needs nothing from ``tests/``.
"""
