"""Sessions: the Redis store (store.py, scripts.py, segment_log.py), the lock (locks.py) and
owner check (owner.py), a turn's stitching into its session (turns.py), live branches
(branches.py), finishing (finish.py) and the idle sweep (sweep.py).
"""
