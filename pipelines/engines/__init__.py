"""What runs on Spark, Beam or simulated devices: prepare's row work, the stats kernels, the user solves, federated
rounds."""
