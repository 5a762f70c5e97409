"""The test kit, for tests, benchmarks and the demo: the float64 brute-force oracle written
from the SPEC (`oracle`); random per-token vectors and caches, and poisoning of memory no
request owns (`synthetic`); hypothesis strategies for property tests of code built on the
cache (`strategies`: configs and request programs)."""
