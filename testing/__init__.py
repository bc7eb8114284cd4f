"""Machinery only the tests and the benchmarks use; not part of the installed package."""
