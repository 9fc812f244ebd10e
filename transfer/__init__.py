"""Moving KV between worker processes: the handoff's messages (`handle.py`), which KV heads each rank
copies when the two pools are sharded differently (`sharding.py`), the NIXL backend that moves the bytes
(`nixl.py`) and UCX's settings (`ucx.py`). engine/ knows nothing of this: it only lays out the pages
(engine/kv_cache.py, engine/kv_geometry.py) that this package describes and copies.
"""
