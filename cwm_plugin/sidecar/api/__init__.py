"""The HTTP routes other than chat (``turn/chat.py``): one module a resource -- memory,
activity, usage, windows and window files, relayed OpenAI routes (``relay.py``) -- plus the
bounded body reader (``body.py``), OpenAI-shaped errors (``errors.py``) and the OpenAPI
schema's request bodies (``schema.py``). Routes only translate HTTP into calls."""
