"""Prefect flows for the eagle3 pipeline: eagle3_pipeline, layer_sweep, retrain and the GPU stage flows."""
