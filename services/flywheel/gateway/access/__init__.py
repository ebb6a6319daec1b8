"""Access: API keys and roles (security.py, the middleware), key routes (keys.py) and rate and
concurrency limits (limits.py).
"""
