"""Every DP release, engine-free: the ledger gate, DP counts, DP mean, Gram matrix, the stats job's plan.

Privacy: every release of the project goes through here: recorded in the run's ledger and charged to
its data source's account before its noise is drawn.
"""
