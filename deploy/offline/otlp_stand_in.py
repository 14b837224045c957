"""A real OTLP receiver standing in for the OpenTelemetry collector and for Jaeger where their
images cannot be pulled (deploy/compose.offline.yaml; neither ships as a Debian or PyPI package).

Two roles, one program:

* ``--config=PATH`` (the collector's own flag and file, deploy/otel-collector.yaml): receives
  OTLP/gRPC and OTLP/HTTP on the ``otlp`` receiver's endpoints, answers the ``health_check``
  extension's endpoint, serves its own metrics on the telemetry ``pull`` port, and forwards every
  trace export unchanged to the endpoint of the first ``otlp*`` exporter of the traces pipeline
  (Jaeger). So the stand-in follows the same file as the real collector: a wrong port or name
  there fails here too.
* ``--jaeger``: what the stack uses of Jaeger: OTLP/gRPC on 4317 and OTLP/HTTP on 4318 in, the
  query API ``/api/services`` and ``/api/traces?service=NAME`` (Jaeger's JSON shape: data[].spans,
  data[].processes) and a 200 on ``/`` on 16686, its metrics on 8888.

Stdlib HTTP, grpcio and opentelemetry-proto only. SIGTERM stops it with exit status 0.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from collections import OrderedDict
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import grpc
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

log = logging.getLogger("otlp-stand-in")
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MAX_MESSAGE = 64 << 20
MAX_TRACES = 5000  # the store keeps the newest traces only


class Store:
    """Spans grouped by trace, in arrival order; counts for /metrics."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.traces: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self.accepted = 0
        self.forwarded = 0
        self.forward_failed = 0

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> int:
        n = 0
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "unknown")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        trace_id = s.trace_id.hex()
                        self.traces.setdefault(trace_id, []).append({
                            "traceID": trace_id,
                            "spanID": s.span_id.hex(),
                            "operationName": s.name,
                            "references": ([{"refType": "CHILD_OF", "traceID": trace_id,
                                             "spanID": s.parent_span_id.hex()}] if s.parent_span_id else []),
                            "startTime": s.start_time_unix_nano // 1000,
                            "duration": max(0, s.end_time_unix_nano - s.start_time_unix_nano) // 1000,
                            "service": service,
                        })
                        self.traces.move_to_end(trace_id)
                        n += 1
            while len(self.traces) > MAX_TRACES:
                self.traces.popitem(last=False)
            self.accepted += n
        return n

    def services(self) -> list[str]:
        with self.lock:
            return sorted({s["service"] for spans in self.traces.values() for s in spans})

    def find(self, service: str, limit: int) -> list[dict[str, Any]]:
        """Jaeger's /api/traces shape: each trace with its spans and a process per service."""
        with self.lock:
            hits = [(tid, list(spans)) for tid, spans in reversed(self.traces.items())
                    if any(s["service"] == service for s in spans)][:limit]
        out = []
        for tid, spans in hits:
            processes: dict[str, str] = {}
            for s in spans:
                processes.setdefault(s["service"], f"p{len(processes) + 1}")
            out.append({
                "traceID": tid,
                "spans": [{**{k: v for k, v in s.items() if k != "service"}, "processID": processes[s["service"]]}
                          for s in spans],
                "processes": {pid: {"serviceName": name, "tags": []} for name, pid in processes.items()},
                "warnings": None,
            })
        return out

    def metrics(self, prefix: str) -> str:
        with self.lock:
            return (f"# TYPE {prefix}_accepted_spans counter\n{prefix}_accepted_spans {self.accepted}\n"
                    f"# TYPE {prefix}_forwarded_exports counter\n{prefix}_forwarded_exports {self.forwarded}\n"
                    f"# TYPE {prefix}_forward_failures counter\n{prefix}_forward_failures {self.forward_failed}\n")


class Receiver:
    """OTLP in (gRPC and HTTP): store, and forward trace exports when a next hop is set."""

    def __init__(self, store: Store, forward: str | None):
        self.store = store
        self.forward = None
        if forward:
            channel = grpc.insecure_channel(forward, options=[("grpc.max_send_message_length", MAX_MESSAGE)])
            self.forward = channel.unary_unary(TRACE_EXPORT)  # raw bytes both ways

    def export(self, body: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        self.store.add(request)
        if self.forward is not None:
            try:
                self.forward(body, timeout=5)
                self.store.forwarded += 1
            except grpc.RpcError as exc:
                self.store.forward_failed += 1
                log.warning("forwarding %d bytes failed: %s", len(body), exc.code())


class GrpcHandler(grpc.GenericRpcHandler):
    def __init__(self, receiver: Receiver):
        self.receiver = receiver

    def service(self, details: Any) -> Any:
        if not details.method.endswith("/Export"):
            return None
        traces = details.method == TRACE_EXPORT

        def export(body: bytes, context: Any) -> bytes:
            if traces:
                self.receiver.export(body)
            return b""  # an empty Export*ServiceResponse; metrics and logs are accepted and dropped

        return grpc.unary_unary_rpc_method_handler(export)


def http_server(endpoint: str, routes: dict[str, Any], receiver: Receiver | None = None) -> ThreadingHTTPServer:
    """GET routes (path -> () -> (status, content type, bytes)); POST /v1/traces: OTLP/HTTP."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def reply(self, status: int, ctype: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # (http.server's name)
            url = urlsplit(self.path)
            route = routes.get(url.path)
            if route is None:
                self.reply(404, "text/plain", b"not found\n")
                return
            try:
                answer = route(parse_qs(url.query))
            except ValueError as exc:  # e.g. limit=abc
                answer = (400, "text/plain", f"{exc}\n".encode())
            self.reply(*answer)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if receiver is None or urlsplit(self.path).path != "/v1/traces" or length > MAX_MESSAGE:
                self.reply(404 if length <= MAX_MESSAGE else 413, "text/plain", b"no\n")
                return
            body = self.rfile.read(length)
            if self.headers.get("Content-Type", "").startswith("application/json"):
                self.reply(415, "text/plain", b"OTLP/HTTP JSON is not supported by this stand-in\n")
                return
            try:
                receiver.export(body)
            except Exception as exc:  # a malformed body is the client's mistake
                self.reply(400, "text/plain", f"{exc}\n".encode())
                return
            self.reply(200, "application/x-protobuf", b"")

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    host, port = split(endpoint)
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host or "0.0.0.0", int(port)


def text(body: str, ctype: str = "text/plain; version=0.0.4") -> Any:
    return lambda _q: (200, ctype, body.encode())


def collector_plan(path: str) -> dict[str, Any]:
    """The endpoints of an otel-collector config (the parts this stand-in implements)."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    protocols = cfg["receivers"]["otlp"]["protocols"]
    pipeline = cfg["service"]["pipelines"]["traces"]
    exporter = next(name for name in pipeline["exporters"] if name.split("/")[0].startswith("otlp"))
    readers = (cfg["service"].get("telemetry") or {}).get("metrics", {}).get("readers", [])
    pull = next((r["pull"]["exporter"]["prometheus"] for r in readers if "pull" in r), None)
    return {
        "grpc": protocols["grpc"]["endpoint"],
        "http": (protocols.get("http") or {}).get("endpoint"),
        "health": cfg["extensions"]["health_check"]["endpoint"],
        "forward": cfg["exporters"][exporter]["endpoint"],
        "metrics": f"{pull['host']}:{pull['port']}" if pull else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    role = ap.add_mutually_exclusive_group(required=True)
    role.add_argument("--config", help="an OpenTelemetry collector config: act as the collector")
    role.add_argument("--jaeger", action="store_true", help="act as Jaeger (OTLP in, query API out)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    store = Store()
    if args.config:
        plan = collector_plan(args.config)
        prefix = "otelcol_stand_in"
    else:
        plan = {"grpc": "0.0.0.0:4317", "http": "0.0.0.0:4318", "health": None, "forward": None,
                "metrics": "0.0.0.0:8888", "query": "0.0.0.0:16686"}
        prefix = "jaeger_stand_in"
    receiver = Receiver(store, plan["forward"])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[GrpcHandler(receiver)],
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE)])
    server.add_insecure_port(plan["grpc"])
    server.start()
    https = []
    if plan["http"]:
        https.append(http_server(plan["http"], {}, receiver))
    if plan["health"]:
        https.append(http_server(plan["health"], {"/": text('{"status":"Server available"}\n', "application/json")}))
    if plan["metrics"]:
        https.append(http_server(plan["metrics"], {"/metrics": lambda q: (200, "text/plain; version=0.0.4",
                                                                          store.metrics(prefix).encode())}))
    if plan.get("query"):
        def traces(q: dict[str, list[str]]) -> tuple[int, str, bytes]:
            service = (q.get("service") or [""])[0]
            limit = int((q.get("limit") or ["20"])[0])
            data = store.find(service, limit)
            return 200, "application/json", json.dumps({"data": data, "total": len(data), "limit": 0,
                                                        "offset": 0, "errors": None}).encode()

        https.append(http_server(plan["query"], {
            "/": text("<html><body>OTLP stand-in for Jaeger: /api/traces?service=NAME</body></html>\n",
                      "text/html"),
            "/api/services": lambda q: (200, "application/json",
                                        json.dumps({"data": store.services(), "total": 0}).encode()),
            "/api/traces": traces,
        }))
    log.info("listening: %s", {k: v for k, v in plan.items() if v})

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    log.info("stopping")
    for h in https:
        h.shutdown()
    server.stop(grace=2).wait()


if __name__ == "__main__":
    main()
