"""Parallelism: the device mesh and sharding rules (tensor parallel), processes on jax.distributed
(multi-host), and engine replicas on disjoint devices (data parallel)."""
