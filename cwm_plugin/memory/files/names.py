"""Validation of memory folder and session names: they become folder and file names.

A name is 1-64 characters of letters, digits, ``_``, ``-`` and ``.``, starting with a letter or
digit, with no ``..``: no path traversal, no separators, no NUL, no hidden files.
"""

from __future__ import annotations

import re

from cwm_plugin.errors import InvalidInput

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ROLE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.'-]{0,63}$")
MAX_LEN = 64


def check_memory_name(kind: str, name: object) -> str:
    """Return ``name`` if it is a safe file name, else raise :class:`InvalidInput`."""
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"{kind} name must be a non-empty string, got {name!r}")
    if len(name) > MAX_LEN:
        raise InvalidInput(f"{kind} name is {len(name)} characters long; use at most {MAX_LEN}")
    if "\x00" in name or "/" in name or "\\" in name or ".." in name or not NAME.fullmatch(name):
        raise InvalidInput(
            f"{kind} name {name!r} is not allowed",
            hint="use letters, digits, '_', '-' or '.', starting with a letter or digit, "
                 "without '..' or path separators",
        )
    return name


def check_role(role: object) -> str:
    """Roles are chat roles (user, assistant, ...) or speaker names; one line, short."""
    if not isinstance(role, str) or not ROLE.fullmatch(role):
        raise InvalidInput(f"role {role!r} is not allowed",
                           hint="use a chat role such as 'user' or a short speaker name")
    return role
