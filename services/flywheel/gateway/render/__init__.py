"""Rendering: chat-template rendering and tokenization of a request (tokenization.py) and the
cache of rendered prefixes (prefix_ids.py); the gateway is the only tokenizer of training data.
"""
