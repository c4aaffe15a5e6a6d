"""Every DP release, engine-free: the ledger gate, DP counts, DP mean, Gram matrix, the stats job's plan."""
