"""Distributed jobs: ingest, protocols (splits), synthetic data, DP counts, user update, the stats job
(Spark entry `pipelines/stats.py` and the Beam pipeline), and the alternating-minimization orchestrator.

Engines are imported lazily inside the jobs that use them: importing this package starts no JVM.

Privacy: the subpackages say theirs; every release goes through pipelines.releases.
"""

import schemas  # noqa: F401  (its warning filter, before Beam or gcsfs is imported)
