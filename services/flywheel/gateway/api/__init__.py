"""Wire APIs: each module turns its own request into one turn and the result into its own
response and stream events (chat.py: Chat Completions; completions.py: text Completions).

schemas.py holds the chat request models; streaming.py and incremental.py the SSE events;
request_rules.py the field rules every API shares; hot_path.py serves chat without FastAPI's
routing; disconnect.py stops a turn whose client left; parsers.py parses tool calls and
reasoning out of sampled text for the client.
"""
