"""Client of the Ferry agents' REST API (standard library only).

- :class:`Client` talks to one agent: a sink (``resolve``, ``lease``,
  ``replica_events``) or a source (``announce``, ``signal``, ``outlook``).
- Errors are :class:`FerryError` with the HTTP status and the agent's
  message.

See ``README.md`` next to this package, and the agent's OpenAPI document
at ``GET /openapi.json``.
"""

from .client import (
    Admission,
    Client,
    FerryError,
    Lease,
    Outlook,
    ReplicaEvent,
    Resolution,
)

__all__ = [
    "Admission",
    "Client",
    "FerryError",
    "Lease",
    "Outlook",
    "ReplicaEvent",
    "Resolution",
]
