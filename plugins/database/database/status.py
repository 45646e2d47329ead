"""The Database's status: phase, ready instances, endpoint, and the `Ready` condition,
with an event whenever the phase or its reason changes."""

from dataclasses import dataclass
from typing import Optional

from capstan import Context, Desired

PENDING = "Pending"
RUNNING = "Running"
DEGRADED = "Degraded"
FAILED = "Failed"
PHASES = (PENDING, RUNNING, DEGRADED, FAILED)


@dataclass(frozen=True)
class Assessment:
    """A judgement of the Database: its phase and why."""

    phase: str
    ready: int
    reason: str
    """CamelCase reason of the Ready condition."""
    message: str
    endpoint: Optional[str] = None


def report(ctx: Context, desired: Desired, engine: str, version: str, a: Assessment) -> None:
    """Writes the status and the Ready condition, and an event when the phase or the
    reason differs from the parent's current status (Warning when Failed)."""
    status = {"engine": engine, "version": version, "phase": a.phase, "readyReplicas": a.ready}
    if a.endpoint:
        status["endpoint"] = a.endpoint
    desired.status(status)
    desired.condition("Ready", a.phase == RUNNING, a.reason, a.message)
    ready_before = ctx.condition("Ready") or {}
    if ctx.status.get("phase") != a.phase or ready_before.get("reason") != a.reason:
        if a.phase == FAILED:
            desired.warning(a.reason, a.message)
        else:
            desired.event(a.reason, f"{a.phase}: {a.message}")
