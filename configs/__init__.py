"""Shipped topology files (`kvrelay serve cpu-tiny.yaml`, the H200 layouts); cluster/topology.py reads them.
"""
