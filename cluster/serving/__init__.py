"""Layer 8, serving: vLLM behind Ray Serve from the laptop: deploy specs and Serve config,
serving health, the engines' transport, the compile cache, bench, tune, plots.
May import: base .. ray.
"""
