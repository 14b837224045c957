"""Who may change what a server serves: model loads and unloads, config overrides, uploads.

Repository control runs code chosen by the caller: a load with ``file:<path>`` parameters (an
*upload*) brings the model's files in the request, and a python model's ``initialize()`` or a
TorchScript module is code. Triton's deployment guide keeps model control off for that reason.
The rule, the same at the gateway and at every service (a service is a full v2 server too):

- **Uploads** are refused unless the operator turns them on (``--allow-model-uploads``), on
  every server whatever else holds: 403 / PERMISSION_DENIED naming the flag.
- **Without tenants** (every service; a gateway without ``--tenants``) load and unload, with or
  without a config override, are taken only from a loopback client unless
  ``--allow-remote-model-control`` opens them: 403 / PERMISSION_DENIED naming the flag.
- **With tenants** the access table decides (``Op.REPOSITORY_LOAD`` / ``UNLOAD`` are admin-only),
  and uploads still need ``--allow-model-uploads``.

PERMISSION_DENIED (HTTP 403): the caller is known and the request well formed, but this server
is not configured to take it from this caller; Triton's own code for a disabled feature
(UNSUPPORTED, HTTP 501) would be a 5xx for a client mistake.
"""
from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from meshserve.protocol.errors import Code, InferError

UPLOADS_FLAG = "--allow-model-uploads"
REMOTE_FLAG = "--allow-remote-model-control"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The two flags, shared by `meshserve gateway`, `meshserve service` and `meshserve up`."""
    ap.add_argument(UPLOADS_FLAG, action="store_true",
                    help="accept model files in load requests (`file:<path>` parameters: code, for python and "
                         "TorchScript models); default off. With tenants, only an admin key may load.")
    ap.add_argument(REMOTE_FLAG, action="store_true",
                    help="without tenants, take model load/unload (and config overrides) from any client, not "
                         "only from loopback ones (a service behind gateways on another host needs it)")


@dataclass(frozen=True)
class ControlPolicy:
    """The operator's choice (the two flags) and the check every load and unload passes."""

    allow_uploads: bool = False
    allow_remote: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ControlPolicy:
        return cls(bool(getattr(args, "allow_model_uploads", False)),
                   bool(getattr(args, "allow_remote_model_control", False)))

    def check(self, action: str, name: str, parameters: Mapping[str, object], peer: str | None,
              tenants: bool) -> None:
        """Raise PERMISSION_DENIED unless this ``action`` ("load" / "unload") of model ``name``
        from ``peer`` (the connection's address, `RequestContext.peer`) is allowed. With
        ``tenants`` the access table has already made sure the caller is an admin."""
        if not self.allow_uploads and any(k.startswith("file:") for k in parameters):
            raise InferError(Code.PERMISSION_DENIED,
                             f"failed to load '{name}': model uploads ('file:' parameters) are off on this server; "
                             f"the operator turns them on with {UPLOADS_FLAG}")
        if not tenants and not self.allow_remote and not is_loopback(peer):
            raise InferError(Code.PERMISSION_DENIED,
                             f"model {action} of '{name}' is taken only from loopback clients on a server without "
                             f"tenants; the operator opens it with {REMOTE_FLAG} (or gives the gateway --tenants)")


def is_loopback(peer: str | None) -> bool:
    """Whether a connection's peer address is a loopback one. ``peer`` is an HTTP client's
    address (``127.0.0.1``, ``::1``) or a gRPC peer string (``ipv4:127.0.0.1:5000``,
    ``ipv6:[::1]:5000``, percent-encoded by grpc C-core); None or anything else: False."""
    if not peer:
        return False
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):
        host = unquote(peer[5:])
        host = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


# Triton's answer to a load whose model it could not read into its repository (a `file:` path it
# cannot write, no `config` with files, a config override that does not parse): "failed to load
# '<m>', failed to poll from model repository" (INTERNAL there; its log says why). meshserve
# answers 400 / INVALID_ARGUMENT, the client's mistake, with Triton's words and the reason after.
FILES_NEED_CONFIG = "Load parameter 'config' must be specified for model file override"


def poll_failed(name: str, why: str) -> InferError:
    """A load request the server could not read: Triton's text, then ``why``."""
    return InferError.invalid(f"failed to load '{name}', failed to poll from model repository: {why}")
