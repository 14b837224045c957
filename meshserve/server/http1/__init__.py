"""meshserve's HTTP/1.1 server on llhttp (httptools), its request and answer types and its route
table's dispatch (docs/security.md, "The HTTP/1.1 front door")."""
from meshserve.server.http1.request import Answer, Request, Stream
from meshserve.server.http1.routing import Router
from meshserve.server.http1.server import Http1Server, start

__all__ = ["Answer", "Http1Server", "Request", "Router", "Stream", "start"]
