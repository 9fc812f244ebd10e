"""The gpt-oss model and its runtime on one device: config, weights, layers, the paged KV cache and its
geometry, partition math and collectives, the runner, sampling and the single-process LLM. No Ray, no
NIXL: distribution lives in workers/ and transfer/.
"""
