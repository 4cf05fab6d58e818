"""Answers beyond findings: the run's summary, suggested prefetch wiring, the
difference of two runs, and findings grouped by cause.
"""
