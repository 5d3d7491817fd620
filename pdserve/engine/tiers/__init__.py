"""The KV tiers below the engine's block pool, device-free: host memory (``host_tier``), files on
disk (``disk_tier``), the read-back of a prompt's blocks from them (``tier_reader``) and the engine's
side of them (``tiered_cache``)."""
