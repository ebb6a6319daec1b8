"""Recording: the typed session record (records.py), what a turn appends to it and when it forks
(history.py), the Sample built from it at publish (sample.py), and the in-memory record cache
(record_cache.py).
"""
