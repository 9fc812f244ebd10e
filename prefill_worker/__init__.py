"""The prefill role of split topologies: the prefill worker actor (`worker.py`), which prefills queued
prompts and pins their KV under a lease for the decode side to pull, and its TP ranks (`ranks.py`).
"""
