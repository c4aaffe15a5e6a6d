"""Data sets before any release: ingest (MovieLens, your own tables), synthetic data, benchmark splits."""
