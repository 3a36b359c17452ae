"""Layer 1, base: what every other layer may use: the typed errors, number bounds,
the bounded YAML loader, text safety, parallel threads, check results, the flag value
types, the one bounded poll/retry helper. May import: nothing of the toolkit but
cluster/data/ (standard library, PyYAML).
"""
