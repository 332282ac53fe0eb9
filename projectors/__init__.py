"""Consumer workers and the read models they build, one shard per log partition."""
