"""The HTTP routes: one module a resource -- chat (``chat.py``: one turn's flow;
``chat_turn.py``: what a turn does once answered), memory, activity, usage, windows and window
files, relayed OpenAI routes (``relay.py``) -- and the OpenAPI schema's request bodies
(``schema.py``); the bounded body reader and OpenAI-shaped errors are ``http/``'s. Routes only
translate HTTP into calls."""
