"""Shared by the adversarial tests: raw HTTP requests, add_sub's inputs."""
from __future__ import annotations

import http.client
from typing import Any

import numpy as np


def raw_http(hostport: str, method: str, path: str, headers: dict[str, str] | None = None,
             body: bytes = b"") -> tuple[int, bytes]:
    """One request on its own connection: (status, body); the path is sent exactly as given."""
    host, port = hostport.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body if method == "POST" else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def add_sub_inputs(module: Any) -> list[Any]:
    """INPUT0 and INPUT1 of add_sub ([1, 16] FP32 ones) for tritonclient.http or .grpc."""
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        inp = module.InferInput(name, [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        inputs.append(inp)
    return inputs
