"""Access: API keys and roles (security.py, the middleware), who sent a request and the role
checks of routes (principal.py), key routes (keys.py) and rate and concurrency limits
(limits.py).
"""
