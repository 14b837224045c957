"""The meshserve gateway: the front door (HTTP/REST + gRPC) in front of the backend services."""
