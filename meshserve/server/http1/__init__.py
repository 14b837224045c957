"""The httptools (llhttp) HTTP/1.1 server: `--http-server httptools` (docs/security.md)."""
from meshserve.server.http1.server import Http1Server, start

__all__ = ["Http1Server", "start"]
