"""The domain operations the checks share: keys, columns, orders and
their first differences, majorities, positions, where each rank stopped.
"""
