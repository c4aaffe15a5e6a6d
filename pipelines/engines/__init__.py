"""What runs on Spark, Beam or simulated devices: prepare's row work, the stats kernels, the user solves, federated
rounds.

Privacy: the engines do the trusted side's row work; every release goes through pipelines.releases
(its ledger and accountant), whichever engine computes it.
"""
