"""eagle3-pipeline: train EAGLE-3 draft models for your own target and serve them in vLLM."""

__version__ = "0.1.0"
