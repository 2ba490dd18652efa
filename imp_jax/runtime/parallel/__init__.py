"""Where arrays live across devices and processes: the device mesh and sharding rules (tensor parallel),
and process 0's broadcast of each program's inputs to the others (multi-host, jax.distributed)."""
