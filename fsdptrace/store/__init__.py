"""The run dir's format, shared by the recorder that writes it and the readers:
table schemas, journal segments, run-dir names and marks. No torch, no pandas.
"""
