"""Layer 3, report: the record of a run (run directory, crash log) and its rendering
(folded tables). May import: base, nodes.
"""
