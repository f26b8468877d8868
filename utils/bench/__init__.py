"""Benchmarks: each figure they print is quoted with its command and machine in docs/benchmarks.md."""
