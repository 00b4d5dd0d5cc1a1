"""SPMD over named mesh axes: ``lax`` collectives with their transposes, ``shard_map`` and its
replication (vma) checks, and the tensor-parallel ``column_parallel``/``row_parallel`` pair.

Imports ``vfsdp.collectives`` and below, never ``functional`` or anything above it.
"""
