"""The KV cache's blocks: the device pool shared by chained prefix hashes, and the tiers under it
(host memory, disk) with their copies, staging and the fingerprint that says which blocks may be shared."""
