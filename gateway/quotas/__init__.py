"""Per-tenant quotas: pure token-bucket maths (bucket.py) and the stores that hold the state."""


class StoreUnavailable(Exception):
    """A store could not answer a quota check (Redis down, unreachable, or too slow). Its text
    is for clients: the cause (which names the store's address) goes to the gateway's log.
    ``retry_after_s``: when the store will be asked again (the answer's Retry-After)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s
