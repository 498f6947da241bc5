"""The host path: where the eager calls of normkit's public functions go first.

`fast` is None (every call takes the Python path in normkit.functional) or an object whose
row_norm(...) / group_norm(...) return the output, or None for a call it does not serve.
"""
fast = None
