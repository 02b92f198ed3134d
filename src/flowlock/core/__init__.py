"""The pure core: definitions, models, steps, errors, data checks and queries.

Nothing here does I/O or imports the rest of flowlock.
"""
