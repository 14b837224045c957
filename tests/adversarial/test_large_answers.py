"""Large answers, made for their client at a front door: compressed (``Accept-Encoding: gzip``),
written as JSON (``binary_data: false``), or as a generate answer. Each costs the front door work
in proportion to the answer (zlib ~10 MB a second here; a JSON number's formatting per element),
and all three ran on the event loop: a client that asked gzip for one 38 MB answer held every
other client of that front door for 4.3-4.9 s, a generate answer of 8 million floats for 3.9 s
(docs/security.md, "Session 23: answers compressed for their client" and "answers written as
JSON"). Now large ones are compressed on threads (meshserve/server/deflate.py) and rendered by the
body worker, in lines per tenant.

The attacker (a tenant with a valid key, at the gateway; at a service, directly) asks, on a few
connections one after the other, for identity_fp32's answer of half a million random floats (2 MiB) in
each of the three forms. The suite's rules: the good client's p99 stays under max(250 ms, 5x its
baseline) with no failure, the attacked process's RSS grows < 100 MiB and comes back; every
answer is a 200 (these are requests the attacker may make)."""
from __future__ import annotations

import collections
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.adversarial.harness import OTHER_KEY, Mesh, Observation, under_attack
from tests.adversarial.test_compressed_floods import compressed_mesh
from tests.support.http1 import connect, read_answer

ELEMENTS = 1 << 19  # FP32: a 2 MiB answer, ~5 MB as JSON
CONNECTIONS = 2
FLOOD_S = 3.0


@pytest.fixture(scope="module")
def stack(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from compressed_mesh(model_repo, tmp_path_factory.mktemp("answers"))


def _requests(hostport: str, key: str | None) -> list[bytes]:
    """The three large answers' requests: gzip of a binary answer, a JSON answer, a generate answer."""
    x = np.random.default_rng(7).random(ELEMENTS).astype(np.float32)
    auth = f"x-api-key: {key}\r\n" if key else ""

    def infer(binary: bool, extra: str) -> bytes:
        head = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, ELEMENTS],
                                       "parameters": {"binary_data_size": 4 * ELEMENTS}}],
                           "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": binary}}]}).encode()
        return (f"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: {hostport}\r\n{auth}{extra}"
                f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(head)}\r\n"
                f"Content-Length: {len(head) + 4 * ELEMENTS}\r\n\r\n").encode() + head + x.tobytes()

    # (three decimals: a 3 MB body, within the tenant's share of --max-receive-bytes; its answer's
    # float32 values come back with all their digits, ~10 MB)
    generate = b'{"INPUT0":' + json.dumps(np.round(x.astype(np.float64), 3).tolist()).encode() + b"}"
    return [infer(True, "Accept-Encoding: gzip\r\n"), infer(False, ""),
            (f"POST /v2/models/identity_fp32/generate HTTP/1.1\r\nHost: {hostport}\r\n{auth}"
             f"Content-Type: application/json\r\nContent-Length: {len(generate)}\r\n\r\n").encode() + generate]


def _large_answers(hostport: str, key: str | None) -> Observation:
    """CONNECTIONS connections asking for the three large answers in turn, one at a time each,
    for FLOOD_S seconds; the status and encoding of every answer (the observation's flag: every
    answer a 200, some of them compressed)."""
    requests = _requests(hostport, key)
    seen: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def one(start: int) -> None:
        deadline = time.monotonic() + FLOOD_S
        sock: socket.socket | None = None
        try:
            i = start
            while time.monotonic() < deadline:
                if sock is None:
                    sock = connect(hostport, timeout=30)
                    reader = sock.makefile("rb")
                sock.sendall(requests[i % len(requests)])
                answer = read_answer(reader)
                with lock:
                    seen[f"{answer.status} {answer.headers.get('content-encoding', 'identity')}"] += 1
                if answer.headers.get("connection", "").lower() == "close":
                    sock.close()
                    sock = None
                i += 1
        finally:
            if sock is not None:
                sock.close()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    answered = sum(seen.values())
    ok = answered > 0 and seen["200 gzip"] > 0 and seen["200 gzip"] + seen["200 identity"] == answered
    return Observation(f"answers {dict(seen)}", ok)


@pytest.mark.parametrize("door", ["gateway", "service"])
def test_large_answers_made_for_their_client_cost_the_good_client_nothing(stack: Mesh, door: str) -> None:
    target = stack.gateway if door == "gateway" else stack.services[0]
    key = OTHER_KEY if door == "gateway" else None  # (a service has no tenants: the gateway in front does)
    verdict = under_attack(stack, target, f"large answers at the {door}",
                           lambda: _large_answers(target.http, key)).judge(expect_refusal=False)
    print(verdict.summary())  # (the figures, shown with -s)
    verdict.check()
    assert verdict.closed_or_refused, f"not every answer was a 200, or none was compressed: {verdict.observed}"
