"""The decode role: continuous batching over a KV pool (`scheduler.py`), the decode worker actor that pulls
KV and streams tokens (`worker.py`) with its TP/EP ranks (`ranks.py`), and the colocated worker that
holds both roles on one GPU (`colocated.py`).
"""
