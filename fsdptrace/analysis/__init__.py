"""The analysis: each rank's tables mapped to summaries, reduced to findings
(in this process, in a pool, or on Dask), and the Analysis object every command uses.
"""
