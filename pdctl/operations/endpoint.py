"""`pdctl endpoint`: where clients reach the service and, only when asked, the router's API key."""

from __future__ import annotations

from pdctl.core.results import (
    EndpointResult,
)
from pdctl.doors import service as services
from pdctl.doors.session import Session


def endpoint(session: Session, name: str, *, show_key: bool) -> EndpointResult:
    """Where clients reach the service and, only when asked, the router's API key.

    The URL comes from the stored plan (no host contacted). The key is read from the router
    host each time and handed to the caller only: pdctl never writes it to the workspace.
    """
    plan = services.load_plan(session.workspace, name)
    return EndpointResult(
        service=name,
        endpoint=services.endpoint(plan),
        endpoints=services.endpoints(plan),
        api_key=services.router_api_key(session, plan) if show_key else None,
    )
