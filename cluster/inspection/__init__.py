"""Layer 4, inspection: what the nodes are: probes (one SSH trip per node), parsers (pure,
tool output -> dataclass), NodeFacts (the one typed read model, each fact parsed once),
checks and the preflight judgement, reachability. Reads only, changes nothing.
May import: base, nodes, report.
"""
