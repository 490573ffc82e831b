"""Typed, range-checked settings dataclasses shared by the connector and the store.

A settings class is a dataclass whose fields may carry limits in their metadata
(``field(default=..., metadata=limits(min=0, max=22, choices=(...)))``) and which calls
:func:`check_fields` from ``__post_init__``: every value is coerced to the field's annotated
type (``"32k"`` -> 32768 for sizes, ``"false"`` -> False) and checked against its limits, and a
bad one raises one :class:`ConfigError` naming the section, the field, what it got and what it
accepts. :func:`load` adds unknown-key detection and the ``<PREFIX><FIELD>`` environment
fallback.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from cwm_plugin.errors import ConfigError

T = TypeVar("T")
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def read_yaml(path: str | os.PathLike[str], what: str = "") -> dict[str, Any]:
    """A YAML file's top-level mapping (an empty file: ``{}``); a file that cannot be read,
    is not YAML or holds no mapping is a :class:`ConfigError` naming it (``what`` it is)."""
    import yaml

    name = f"{what} {path}".strip()
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {name}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must hold a mapping at the top level")
    return data


def limits(*, min: float | None = None, max: float | None = None,
           choices: tuple | None = None, secret: bool = False) -> dict[str, Any]:
    """Field metadata: the accepted range or values; ``secret`` keeps it out of messages."""
    return {"min": min, "max": max, "choices": choices, "secret": secret}


def load(cls: type[T], data: Mapping[str, Any] | None, *, env_prefix: str, section: str,
         env: Mapping[str, str] | None = None, skip_env: tuple[str, ...] = ()) -> T:
    """Build ``cls`` from ``data``; fields missing there come from ``<env_prefix><FIELD>``."""
    data = dict(data or {})
    env = os.environ if env is None else env
    fields = {f.name for f in dataclasses.fields(cls)}     # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"unknown {section} setting {unknown[0]!r}",
                          hint=f"known settings: {', '.join(sorted(fields))}")
    values = dict(data)
    for name in fields - set(data) - set(skip_env):
        if env_prefix + name.upper() in env:
            values[name] = env[env_prefix + name.upper()]
    return cls(**values)


def check_fields(obj: Any, section: str) -> None:
    """Coerce every field of ``obj`` to its type and check its limits (in place)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        meta = f.metadata
        value = coerce(section, f.name, getattr(obj, f.name), hints[f.name],
                       secret=bool(meta.get("secret")))
        object.__setattr__(obj, f.name, value)
        if value is None or isinstance(value, bool | dict | list):
            continue
        shown = "<hidden>" if meta.get("secret") else repr(value)
        choices = meta.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{section} setting {f.name} must be one of "
                              f"{', '.join(map(str, choices))}; got {shown}")
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            rng = (f"between {lo} and {hi}" if lo is not None and hi is not None
                   else f">= {lo}" if lo is not None else f"<= {hi}")
            raise ConfigError(f"{section} setting {f.name} must be {rng}; got {shown}")


def coerce(section: str, name: str, value: Any, hint: Any, *, secret: bool = False) -> Any:
    """``value`` (maybe a string from the environment or JSON) as the type ``hint``."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if value is None or (optional and isinstance(value, str)
                         and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{section} setting {name} cannot be null")
    origin = typing.get_origin(hint) or hint
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError(value)
        if hint in (int, float):
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, str):
                return hint(parse_size(value)) if hint is int else float(value)
            if hint is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return hint(value)
        if hint is str:
            if not isinstance(value, str | Path):
                raise ValueError(value)
            return str(value)
        if origin in (dict, list) and not isinstance(value, origin):
            raise ValueError(value)
    except (ValueError, TypeError, OverflowError) as exc:
        kind = {bool: "true or false", int: "an integer (sizes may say 32k, 2G)",
                float: "a number", str: "a string"}.get(hint, getattr(origin, "__name__", "?"))
        shown = "<hidden>" if secret else repr(value)
        raise ConfigError(f"{section} setting {name} must be {kind}; got {shown}") from exc
    return value


def parse_size(text: str) -> int:
    """``"123"``, ``"32k"``, ``"2G"``, ``"512MiB"``, ``"1.5gb"`` -> an integer (binary units)."""
    s = text.strip().lower().replace("_", "")
    for suffix in ("ib", "b"):
        if s.endswith(suffix) and len(s) > len(suffix) and s[-len(suffix) - 1].isalpha():
            s = s[: -len(suffix)]
            break
    if s and s[-1] in _UNITS:
        return int(float(s[:-1]) * _UNITS[s[-1]])
    return int(s)
