"""The error a failed pull raises when the prefill side answered (or hung up)."""


class PullError(ConnectionError):
  """The prefill side answered a pull with an error (its offer was released, it closed the
  connection, or the page sizes disagree). Like :class:`TimeoutError` it is an
  :class:`OSError`: ``except OSError`` catches every failed pull."""


__all__ = ["PullError"]
