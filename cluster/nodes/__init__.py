"""Layer 2, nodes: the inventory (cluster.yaml validated) and the transport to the nodes
(SSH/local runners, sessions, shell quoting, secrets on stdin, bounded output); what
the inventory implies: the head's endpoints, the env `ray start` gives a node.
cluster/node_programs/ (the programs shipped to nodes and their runner) is the same
layer. May import: base.
"""
