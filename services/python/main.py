"""`meshserve service python`: Triton python-backend models (model.py), a worker process per instance."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from meshserve.repository.config import BACKEND_COMPLETERS
from services.base import main as base_main
from services.python.autocomplete import complete
from services.python.bls import BLS_API_KEY_ENV, BLS_TLS_ENV
from services.python.core import PythonOptions, PythonServiceCore

BLS_KEY_FLAG = "--bls-api-key-file"
_MAX_KEY_BYTES = 4096


def read_api_key(path: Path) -> str:
    """The API key in ``path`` (one line; surrounding whitespace ignored). SystemExit naming the
    file and the flag when it cannot be read or is not a key gRPC metadata can carry."""
    where = f"meshserve service python: {BLS_KEY_FLAG} {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise SystemExit(f"{where}: cannot read the key file ({exc.strerror or exc})") from None
    if len(raw) > _MAX_KEY_BYTES:
        raise SystemExit(f"{where}: the key file is larger than {_MAX_KEY_BYTES} bytes; it holds one API key")
    key = raw.strip()
    if not key:
        raise SystemExit(f"{where}: the key file is empty")
    if any(b < 0x21 or b > 0x7E for b in key):
        raise SystemExit(f"{where}: the key must be one line of printable ASCII without spaces")
    return key.decode("ascii")


def bls_tls(args: argparse.Namespace) -> None:
    """The BLS channel's TLS, for the workers (services/python/bls.py:credentials, through the
    environment: paths only); SystemExit when a file does not load."""
    import ssl

    for var in BLS_TLS_ENV.values():
        os.environ.pop(var, None)
    root, cert, key = args.bls_root_cert, args.bls_client_cert, args.bls_client_key
    if not (args.bls_use_ssl or root or cert):
        return
    if bool(cert) != bool(key):
        raise SystemExit("meshserve service python: --bls-client-cert and --bls-client-key go together")
    try:  # (what the workers will load, checked once here)
        ctx = ssl.create_default_context(cafile=str(root) if root else None)
        if cert:
            ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise SystemExit(f"meshserve service python: --bls-use-ssl: cannot load the certificate files: {exc}") from None
    os.environ[BLS_TLS_ENV["on"]] = "1"
    for name, path in (("root", root), ("cert", cert), ("key", key)):
        if path:
            os.environ[BLS_TLS_ENV[name]] = str(Path(path).resolve())


def main(args: argparse.Namespace) -> None:
    BACKEND_COMPLETERS["python"] = complete  # auto_complete_config, in this process only
    # BLS calls are made as this service's identity: the workers inherit the key through the
    # environment (never a command line, which `ps` shows); without the flag, no key at all
    if args.bls_api_key_file is not None:
        os.environ[BLS_API_KEY_ENV] = read_api_key(args.bls_api_key_file)
    else:
        os.environ.pop(BLS_API_KEY_ENV, None)
    bls_tls(args)
    PythonServiceCore.options = PythonOptions(bls_target=args.bls_target or "",
                                              execute_timeout_s=args.python_execute_timeout,
                                              log_level=args.log_level)
    base_main.main("python", {}, args, core_cls=PythonServiceCore)
