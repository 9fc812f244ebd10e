"""What the two worker roles (prefill_worker/, decode_worker/) share, in one place outside engine/:
the messages that cross an actor boundary (`messages.py`), the frozen per-role specs cluster/ builds
from the topology (`specs.py`), loading a role's Runner (`loading.py`) and the ranks of a TP worker over
Ray (`rank_group.py`). The roles import this package and never each other (except the colocated worker,
which is a decode worker that also prefills); engine/ never imports it.
"""
