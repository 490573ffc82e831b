"""Versions of the sidecar's secret, so that rotating it orphans nobody's memory.

``secrets:`` lists versions newest first, each ``{id, value | env, until?}``. The newest derives
everything (cache salts, user namespaces and session names); an older one is still *looked up*
until its ``until`` (the end of its grace period; none: until it is removed from the list): a
user whose namespace folder was named with an older version (``u-`` + HMAC(old, user)) is found
there and moved to the name the newest gives (:func:`migrate_folder`: the folder and the files
named after the user's default session), once, the first time it is looked up. Cache salts are
moved by the sidecar when it has a windows store (``salt_move.py``: a session's stored KV is
re-keyed to its new salt on its first request); without one the KV cache is a cache, a
session's next turn after a rotation computes its prefix again under the new salt. Without
``secrets:``, ``secret`` / ``secret_env`` is the one version.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from pydantic import SecretStr, field_validator, model_validator

from cwm_plugin.config_file import Strict
from cwm_plugin.errors import ConfigError

log = logging.getLogger(__name__)
SECRET_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
MIN_CHARS = 16
Locate = Callable[[list[str]], str]  # [folder names, the newest version's first] -> the one


class SecretVersion(Strict):
    """One version of the secret: its value from the file or an environment variable."""

    id: str
    value: SecretStr | None = None
    env: str | None = None
    until: datetime | None = None  # its grace period ends then (older versions only)

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not SECRET_ID.fullmatch(v):
            raise ValueError(f"secret id {v!r} must match {SECRET_ID.pattern}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> SecretVersion:
        if (self.value is None) == (self.env is None):
            raise ValueError(f"secret {self.id!r}: give exactly one of `value` and `env`")
        return self

    def read(self) -> bytes:
        value = self.value.get_secret_value() if self.value is not None \
            else os.environ.get(self.env or "")
        if not value or len(value) < MIN_CHARS:
            where = f"${self.env}" if self.env else "its value"
            raise ConfigError(f"secret {self.id!r} is missing or too short",
                              hint=f"set {where} to {MIN_CHARS}+ random characters")
        return value.encode()


def alive(v: SecretVersion, now: datetime | None = None) -> bool:
    """An older version is looked up until its ``until`` (naive: UTC; none: for ever)."""
    until = v.until if v.until is None or v.until.tzinfo else v.until.replace(tzinfo=UTC)
    return until is None or until > (now or datetime.now(UTC))


def in_grace(versions: list[SecretVersion], now: datetime | None = None) -> list[bytes]:
    """The values to use, newest first: the newest always, older ones until their ``until``."""
    now = now or datetime.now(UTC)
    return [v.read() for i, v in enumerate(versions) if i == 0 or alive(v, now)]


def migrate_folder(root: Path, old: str, new: str) -> bool:
    """Move a user's memory folder ``old`` to ``new`` (and, inside, the files named after the
    session ``old``); False when there is nothing at ``old`` or ``new`` exists already. The
    derived index of ``old`` is dropped (rebuilt from the files under ``new``)."""
    src, dst = root / old, root / new
    if not src.is_dir() or dst.exists():
        return False
    try:
        src.rename(dst)
    except OSError:  # another process moved it first
        return dst.exists()
    for sub, ext in (("sessions", ".md"), ("summaries", ".md"), ("cursors", ".json")):
        f = dst / sub / f"{old}{ext}"
        if f.exists():
            f.rename(dst / sub / f"{new}{ext}")
    shutil.rmtree(root / ".index" / old, ignore_errors=True)
    log.info("a user's memory moved to the newest secret's name (%s... -> %s...)", old[:8],
             new[:8])
    return True


def folder_locator(root: Path) -> Locate:
    """Where a user's memory is: the newest name, after moving it there from the first older
    name that has a folder (see the module docstring)."""
    def locate(names: list[str]) -> str:
        newest = names[0]
        if len(names) > 1 and not (root / newest).exists():
            for old in names[1:]:
                if migrate_folder(root, old, newest):
                    break
        return newest

    return locate
