"""The YAML settings file (``configs/sidecar.yaml``) every package reads its own section of.

The sidecar validates the whole file into its ``Settings``, which composes each package's settings
model; a package's CLI (``cwm memory --config``, ``cwm activity --config``) reads just its own
section with :func:`load_section`. Either way the file is read by
:func:`~cwm_plugin.typed_config.read_yaml`, a model is validated by :func:`validate` (errors name
the field, never echo the input: a misplaced secret must not end up in a log line), and relative
paths are taken from the file's folder (:func:`beside`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from cwm_plugin.errors import ConfigError
from cwm_plugin.typed_config import read_yaml

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """A settings model that refuses unknown keys (a typo is an error, never ignored)."""

    model_config = ConfigDict(extra="forbid")


def validate(model: type[M], raw: Any, path: str | os.PathLike[str], section: str = "") -> M:
    """``raw`` as ``model``; a :class:`ConfigError` naming ``path`` and each bad field (under
    ``section``) otherwise."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        where = [section] if section else []
        problems = "; ".join(f"{'.'.join(map(str, [*where, *e['loc']]))}: {e['msg']}"
                             for e in exc.errors(include_input=False))
        raise ConfigError(f"{path}: {problems}") from None


def load_section(model: type[M], path: str | os.PathLike[str], section: str) -> M | None:
    """The file's ``section`` as ``model``; None when the file has no such section."""
    raw = read_yaml(path).get(section)
    return None if raw is None else validate(model, raw, path, section)


def beside(path: Path, config_file: str | os.PathLike[str]) -> Path:
    """``path`` as given when absolute, else relative to the folder of ``config_file``."""
    return path if path.is_absolute() else (Path(config_file).parent / path).resolve()


POSTGRES_URL_ENV = "CWM_POSTGRES_URL"


def postgres_url_or_env(url: Any, section: str) -> Any:
    """A section's ``postgres_url`` (a ``SecretStr``), else ``$CWM_POSTGRES_URL`` (a password
    kept out of the file); ValueError naming both when neither is set."""
    if url is not None:
        return url
    from pydantic import SecretStr

    env = os.environ.get(POSTGRES_URL_ENV)
    if not env:
        raise ValueError(f"{section}.backend is postgres but there is no postgres_url: set "
                         f"{section}.postgres_url or ${POSTGRES_URL_ENV}")
    return SecretStr(env)

