"""The gateway's front door installs its at-once hook (grpc_frontend.register: with tenants on the
door's first indexed entry, ``FrontDoor.on_first_entry``; without, at register) on every gRPC
server registered over the same core, exactly once each, whenever that server was registered
(session 10 review).

One process has one gRPC server today (meshserve/server/process.py:serve); the door and the hook
are per process, so with ``--workers N`` each worker's own door installs on its own server (and
with the shared local cache there is no door: gateway/core.py). Before this, a second
``register`` over the same core replaced the first server's callback: that server lost its
hook and (``servicer.hit = None``) its front-door answers too, every hit going to the pipeline."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

from gateway.cache import FrontDoor, LocalCache
from meshserve.server import access
from meshserve.server.grpc_frontend import register
from meshserve.server.h2 import H2GrpcServer
from meshserve.server.health import HealthState
from tests.support.stub_core import StubCore

PATH = f"/{access.GRPC_SERVICE}/ModelInfer"


class DoorCore(StubCore):
    def __init__(self, door: FrontDoor):
        self.grpc_front = door
        self.grpc_hit = door.grpc


def _door(admission: Any = None) -> FrontDoor:
    return FrontDoor(None, LocalCache(1 << 20), Counter(), admission)  # type: ignore[arg-type]  # (the stage is not read here)


def _entry() -> Any:
    return ("m", "", None, b"key", [0, 0, 0], ("m", "OK"))


def test_every_grpc_server_over_one_door_gets_its_hook_once() -> None:
    door = _door(admission=SimpleNamespace(store=None))  # (with tenants: installed on the door's first entry)
    core = DoorCore(door)
    first, second = H2GrpcServer(), H2GrpcServer()
    register(first, core, HealthState())  # type: ignore[arg-type]
    register(second, core, HealthState())  # type: ignore[arg-type]
    assert PATH not in first.at_once and PATH not in second.at_once  # nothing repeated yet: no hook
    door.index(b"front-key", _entry())
    hook = first.at_once[PATH]
    assert hook[1] is True and hook[0].__self__ is not second.at_once[PATH][0].__self__  # (each its servicer's)
    assert second.at_once[PATH][1] is True
    door.entries.clear()  # emptied (its byte share) and refilled: installed again, still one hook
    door.index(b"other-key", _entry())
    assert first.at_once[PATH] is hook and list(first.at_once) == [PATH]


def test_a_server_registered_after_the_first_entry_gets_the_hook_at_once() -> None:
    door = _door(admission=SimpleNamespace(store=None))  # (with tenants: installed on the first entry)
    core = DoorCore(door)
    first = H2GrpcServer()
    register(first, core, HealthState())  # type: ignore[arg-type]
    door.index(b"front-key", _entry())
    late = H2GrpcServer()
    register(late, core, HealthState())  # type: ignore[arg-type]
    assert late.at_once[PATH][1] is True and first.at_once[PATH][1] is True


def test_without_tenants_the_hook_is_installed_at_once_and_once() -> None:
    """Without tenants a call the door declines from its two frames costs less than the usual path
    (ServerConnection._at_once opens its stream itself): the hook is there before any entry."""
    door = _door()
    core = DoorCore(door)
    first = H2GrpcServer()
    register(first, core, HealthState())  # type: ignore[arg-type]
    assert first.at_once[PATH] == (door.grpc, False) and not door.entries
    hook = first.at_once[PATH]
    door.index(b"front-key", _entry())
    door.entries.clear()
    door.index(b"other-key", _entry())
    assert first.at_once[PATH] is hook and list(first.at_once) == [PATH]
