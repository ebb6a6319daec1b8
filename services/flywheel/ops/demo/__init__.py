"""The demo: an ordinary OpenAI-SDK agent learns single-digit addition through the gateway."""
