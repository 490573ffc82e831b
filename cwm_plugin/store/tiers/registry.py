"""The tier registry: each tier's name, in lookup order, and the module that opens it.

As vLLM's ``kv_offload`` factory names its backends by module path, an entry names the module
whose ``open_tier(config)`` builds the tier from a
:class:`~cwm_plugin.store.config.StoreConfig`, or returns None when the config does not ask
for it. The module is imported only then, so a store without Redis never imports redis-py.
A new tier is a subpackage with such a function and one :func:`register` line below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from cwm_plugin.store.tiers.base import Tier

Opener = Callable[[Any], Tier | None]     # a StoreConfig -> the tier, or None: not asked for

_TIERS: dict[str, str] = {}               # name -> module with open_tier, in lookup order


def register(name: str, module: str) -> None:
    """Add (or replace) the tier ``name``, opened by ``module``'s ``open_tier``; a new name
    goes last in lookup order."""
    _TIERS[name] = module


def names() -> list[str]:
    """The registered tiers, in lookup order (fastest first)."""
    return list(_TIERS)


def opener(name: str) -> Opener:
    """The ``open_tier`` function of tier ``name``."""
    return importlib.import_module(_TIERS[name]).open_tier


register("memory", "cwm_plugin.store.tiers.ram.tier")
register("disk", "cwm_plugin.store.tiers.disk.tier")
register("redis", "cwm_plugin.store.tiers.redis.tier")
