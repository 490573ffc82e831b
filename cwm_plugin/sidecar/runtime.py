"""Everything one app instance owns, built once by ``create_app`` and kept on ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass, field

from cwm_plugin.activity.log import ActivityLog
from cwm_plugin.sidecar.background.maintainer import Maintainer
from cwm_plugin.sidecar.background.queue import Background
from cwm_plugin.sidecar.background.shared_jobs import SharedJobs
from cwm_plugin.sidecar.identity.authenticator import Authenticator
from cwm_plugin.sidecar.identity.ratelimit import TenantLimits
from cwm_plugin.sidecar.identity.salt_move import SaltMover
from cwm_plugin.sidecar.identity.tenant_bounds import TenantBound, TenantPool
from cwm_plugin.sidecar.metrics import SidecarMetrics
from cwm_plugin.sidecar.settings import Settings
from cwm_plugin.sidecar.turn.counting import ModelCounters
from cwm_plugin.sidecar.turn.failopen import FailOpen
from cwm_plugin.sidecar.turn.memory_port import MemoryPort
from cwm_plugin.sidecar.turn.session import ContextTracker, SnapshotHook, noop_snapshot
from cwm_plugin.sidecar.turn.shared_state import SharedSessions
from cwm_plugin.sidecar.upstream.router import Router
from cwm_plugin.sidecar.usage import UsageLedger
from cwm_plugin.windows.engine import WindowEngine


@dataclass
class Sidecar:
    settings: Settings
    auth: Authenticator
    router: Router
    memory: MemoryPort | None
    metrics: SidecarMetrics
    maintainer: Maintainer | None
    counters: ModelCounters
    failopen: FailOpen
    usage: UsageLedger
    limits: TenantLimits
    in_flight: TenantBound  # each principal's requests in flight (identity/in_flight.py)
    # every window-engine and store call, within its principal's share (tenant_bounds.py)
    window_pool: TenantPool
    restores: TenantPool  # prompt-state reads of continuing sessions (turn/records.py)
    activity_pool: TenantPool  # the activity log's file work (api/activity.py)
    activity: ActivityLog | None = None
    tracker: ContextTracker = field(default_factory=ContextTracker)
    background: Background = field(default_factory=Background)
    snapshot_hook: SnapshotHook = noop_snapshot
    salt_mover: SaltMover | None = None  # with a windows store and older secret versions
    windows: WindowEngine | None = None  # with a windows store (turn/records.py)
    shared: SharedSessions | None = None  # session state shared by replicas (shared_state.py)
    jobs: SharedJobs | None = None  # background jobs shared by replicas (shared_jobs.py)
