"""Device kernels (Triton, FlashInfer, cuBLAS) and their torch references (`reference.py`), which CPU
runs and the tests use as ground truth. A leaf: it imports nothing else of kvrelay.
"""
