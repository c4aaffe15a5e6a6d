"""What every stage shares: progress output, one-line errors, locks, how a command ends.

Privacy: reads no private data and releases nothing.
"""
