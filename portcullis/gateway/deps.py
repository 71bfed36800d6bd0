"""FastAPI dependency aliases, so a route's signature says what it needs."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from portcullis.gateway.state import GatewayState


async def get_gateway(request: Request) -> GatewayState:
    # async on purpose: FastAPI runs a sync dependency in a thread pool, per request.
    return request.app.state.gateway


GatewayDep = Annotated[GatewayState, Depends(get_gateway)]
