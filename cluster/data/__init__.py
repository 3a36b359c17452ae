"""Data files: default expectations, templates, GPU facts."""
