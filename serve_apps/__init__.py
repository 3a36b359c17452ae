"""Ray Serve applications serving vLLM (import_path targets for Serve configs).

- serve_apps.vllm_app:build_app      dense models (TP inside a node, PP across nodes, replicas = DP)
- serve_apps.vllm_app:build_moe_app  MoE models (DP attention + expert parallel, gang-scheduled)

serve_apps.config holds the args' validation and the placement decisions (no Ray or vLLM
import); docs/serving.md describes the args and what is verified where.
"""
