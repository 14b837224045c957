"""The TLS tests' throwaway certificates: meshserve/server/certs.py's."""
from meshserve.server.certs import Authority, Issued, authority

__all__ = ["Authority", "Issued", "authority"]
