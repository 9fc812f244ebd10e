"""The model's layers (attention, MoE, linear, norm, rotary, embedding), each sharded by the rank it runs on.
"""
