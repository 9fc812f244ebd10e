"""Running a cluster: the `kvrelay` CLI, the topology file and the per-role specs cut from it, Ray
placement and supervision of the worker actors, and the engine client the router talks to.
"""
