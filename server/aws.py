"""Settings every AWS client of a node shares (DynamoDB, its stream, SQS), and
``ap-realtime seed-bot``'s."""

from __future__ import annotations

from typing import Any

from botocore.config import Config

from server import __version__

USER_AGENT = f"ap-realtime/{__version__}"
"""A fixed ``User-Agent`` (the session appends botocore's version). Without one,
botocore assembles its own from a dozen parts for every request, twice (once more
before signing): about a fifth of a call's CPU, on the CPU that fans events out
(``python -m loadtest.scenarios.store_calls``, ``loadtest/results/HISTORY.md``)."""


def client_config(**settings: Any) -> Config:
    """A botocore ``Config`` with ``settings`` and the node's fixed ``User-Agent``
    (aiobotocore takes a plain ``Config`` and wraps it in its own)."""
    return Config(user_agent=USER_AGENT, **settings)
