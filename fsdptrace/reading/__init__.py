"""A run dir read back: validated tables, how each rank ended, which
micro-steps are incomplete, and the facts its tables state (all-gathers, unsharded bytes).
"""
