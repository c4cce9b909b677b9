"""Prefect Block types for the eagle3 pipeline (blocks/eagle3_blocks.py).

Register them with a server (once per server):  python -m eagle3_prefect.blocks.register
"""
