"""Layer 6, remedy: changes to nodes' files, planned purely: fix steps and what undo may
restore, the undo record, model file copies (what is missing where, the relay's shape,
the laptop's feed of a local directory).
May import: base, nodes, report, inspection, planning.
"""
