"""The engine, inside the training process: hooks, statistics, rules, origins, hits, pausing."""
