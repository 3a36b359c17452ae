"""Layer 5, planning: pure decisions about a deployment: the model's shape (modelinfo),
the plan (TP/PP/DP/EP, engine args), the plan file, the gang layout, the fabric's
groups, thresholds, needs and proof verdicts. No SSH, no Ray. May import: base, nodes,
report, inspection.
"""
