"""Data sets before any release: ingest (MovieLens, your own tables), synthetic data, benchmark splits.

Privacy: everything here reads or writes private rows on the trusted side; nothing is released
(pipelines.releases makes every release).
"""
