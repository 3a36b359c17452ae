"""Layer 9, playbooks: the orchestrations, one per command that judges or changes the cluster.

Every playbook: options -> gather (read-only) -> plan (pure) -> dry run stops -> confirm
(injected) -> execute -> verify -> an outcome; progress through `on_event`; nothing printed.
May import: every cluster/ layer below (base .. serving), never cluster/commands/ or cluster/cli.py.
"""
