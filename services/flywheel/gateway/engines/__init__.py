"""Engines: the `Generation` type (generation.py), the engine pool and its plain `/generate`
client (pool.py), streamed `/generate` (stream.py), stop reconciliation (stops.py) and a turn's
engine calls with the context check (calls.py).
"""
