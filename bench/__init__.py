"""Benchmarks, each guarding a claim in BENCHMARKS.md (its table says which); every one checks
its own outcomes before it reports a rate."""
