"""`/healthz` (this process is alive) and `/readyz` (the engine answers its health check).

Probes carry no credentials and reveal little more than up/down, so they are not audited: a
kubelet polling every few seconds would otherwise drown the reviewers' log. `/readyz` is 503
while the engine is down or, under `audit.on_failure: refuse`, while the audit log cannot be
written (every request would be refused), so load balancers send traffic elsewhere. While the policy
files on disk are refused, `/readyz` says so (still 200: the last good policy serves); why
is in the log and the admin-only metrics, not here.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from portcullis.gateway.deps import GatewayDep
from portcullis.gateway.state import GatewayState

router = APIRouter()


@router.get("/healthz", include_in_schema=False)
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz", include_in_schema=False)
async def readyz(gateway: GatewayDep) -> JSONResponse:
    body = {"status": "ready"} | _policy_warning(gateway)
    if await gateway.refusing_unaudited():
        body["status"] = "audit log unavailable"  # every request is refused 503 until it recovers
    elif not await _engines_up(gateway):
        body["status"] = "engine unavailable"
    else:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"retry-after": "1"})


async def _engines_up(gateway: GatewayState) -> bool:
    """The one engine answers its health check, or (a policy's upstreams) one replica is up."""
    fleet = gateway.fleet
    if fleet.listed:
        return fleet.healthy()
    return await next(iter(fleet.replicas.values())).client.healthy()


def _policy_warning(gateway: GatewayState) -> dict[str, object]:
    """Present only while the policy files on disk are refused: still ready (the last good
    policy serves), but what is on disk is not what serves."""
    status = gateway.store.status()
    if not status["reload_refused"]:
        return {}
    return {"policy": {"reload_refused": True, "serving_generation": status["generation"]}}
