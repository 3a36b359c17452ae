"""cluster: turn bare-metal GPU servers into a verified Ray cluster serving vLLM."""

__version__ = "0.1.0"
