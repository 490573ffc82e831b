"""Who is asking and what it may do: API keys to principals, users and sessions, their salts
(``authenticator.py``), the authentication dependency every route runs first (``caller.py``), the
access matrix (``access.py``; its settings: ``settings/access.py``), per-tenant rate limits and
token quotas (``ratelimit.py``), and the KV that follows a rotation of the secret (``salt_move.py``;
the secret's versions: ``settings/secret_versions.py``)."""
