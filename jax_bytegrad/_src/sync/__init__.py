"""The sync: a gradient's mean between nodes, planned once (config), cut into buckets,
sent on a wire (full precision or codes) with collective patterns, on a node's shards."""
