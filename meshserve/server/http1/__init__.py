"""The httptools (llhttp) HTTP/1.1 server: `--http-server httptools` (docs/security.md)."""
from meshserve.server.http1.request import Answer, Request
from meshserve.server.http1.server import Http1Server, start

__all__ = ["Answer", "Http1Server", "Request", "start"]
