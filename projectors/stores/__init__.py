"""Read models of one shard: vector, lexical, graph, history, events."""
