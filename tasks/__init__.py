"""Prefect tasks for the eagle3 pipeline: one per stage (tasks/stages.py), thin over the library."""
