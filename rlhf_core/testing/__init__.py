"""Helpers the test suite and the benchmarks share: free loopback ports, a picklable metrics
sink, the tiny pipeline config, a tiny servable policy and a gateway in its own process.

They live in the package (as `prefect.testing` and `ray`'s test utilities do) so that
`tests/` and `bench/` both import them and neither imports the other.
"""
