"""Benchmarks of the kernels, the runner, prefill, decode and the served API; each result is stored in
bench/results/ with the GPU, commit and command that produced it.
"""
