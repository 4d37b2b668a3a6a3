"""The client: one class, typed answers, no dependencies.

Times are Unix milliseconds (as the API gives them), sizes bytes, rates
bit/s. Durations sent to the agent are strings the agent reads (``"10m"``,
``"2h"``, ``"30s"``) or seconds (converted here).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Union

Duration = Union[str, int, float]
"""A duration: a string the agent reads (``"10m"``) or seconds."""


def _duration(d: Duration) -> str:
    if isinstance(d, str):
        return d
    if d <= 0:
        raise ValueError(f"a duration must be positive, got {d}")
    return f"{int(round(d * 1000))}ms"


class FerryError(Exception):
    """An answer other than 2xx, or an agent that could not be reached.

    ``status`` is the HTTP status (0 when no answer came), ``message`` the
    agent's ``error`` text (or the transport's).
    """

    def __init__(self, status: int, message: str, method: str = "", path: str = ""):
        super().__init__(f"{method} {path}: {status or 'no answer'}: {message}".strip())
        self.status = status
        self.message = message


@dataclass
class Lease:
    """A reader lease on a replica version (``lease`` of a resolve)."""

    id: str
    holder: str
    expires_at: int
    raw: Dict[str, Any] = field(repr=False, default_factory=dict)


@dataclass
class Resolution:
    """Where a source path is at a sink (``GET /v1/resolve``).

    ``state`` is ``local``, ``replicating``, ``remote`` or ``unknown``;
    ``local_path`` (POSIX sink) or ``url`` (HDFS or S3 sink) when local;
    ``profile`` is ``weights-only`` for a replica without optimizer state
    (a weights-only root, or the first version of a weights-first
    publish), else ``None``.
    """

    state: str
    local_path: Optional[str]
    url: Optional[str]
    replica: Optional[int]
    lease: Optional[Lease]
    raw: Dict[str, Any] = field(repr=False, default_factory=dict)
    profile: Optional[str] = None

    @property
    def location(self) -> Optional[str]:
        """The local path, else the URL, of a ``local`` answer."""
        return self.local_path or self.url


@dataclass
class Admission:
    """The answer to a deadline: whether the link's queue makes it.

    ``eta_ms`` is when the scheduler's fluid model has it ready;
    ``class_needed`` the class that would make it, or ``bytes_over`` the
    bytes over budget when none would.
    """

    feasible: bool
    deadline_ms: int
    eta_ms: int
    margin_ms: int
    class_needed: Optional[str]
    bytes_over: Optional[int]
    endangers: List[int]


@dataclass
class Outlook:
    """What a job can expect from its link (``GET /v1/jobs/{job}/outlook``).

    When ``keeps_up`` is false: replicate every ``every_k``-th checkpoint,
    or the link would need ``rate_needed_bps``.
    """

    backlog_bytes: int
    backlog_ready_ms: Optional[int]
    checkpoint_bytes: int
    ahead_bytes: int
    next_ready_ms: Optional[int]
    cadence_ms: Optional[int]
    carried_bps: int
    keeps_up: Optional[bool]
    every_k: Optional[int]
    rate_needed_bps: Optional[int]


@dataclass
class ReplicaEvent:
    """One publish event (``GET /v1/replicas/events``).

    ``id`` is the event log's id (resume after it with ``since``), ``kind``
    ``published``, ``replaced`` or ``removed``; ``data`` the event's JSON.
    """

    id: int
    kind: str
    data: Dict[str, Any]


def _outlook(v: Dict[str, Any]) -> Outlook:
    return Outlook(
        backlog_bytes=v["backlog_bytes"],
        backlog_ready_ms=v.get("backlog_ready_ms"),
        checkpoint_bytes=v["checkpoint_bytes"],
        ahead_bytes=v["ahead_bytes"],
        next_ready_ms=v.get("next_ready_ms"),
        cadence_ms=v.get("cadence_ms"),
        carried_bps=v["carried_bps"],
        keeps_up=v.get("keeps_up"),
        every_k=v.get("every_k"),
        rate_needed_bps=v.get("rate_needed_bps"),
    )


def _admission(v: Optional[Dict[str, Any]]) -> Optional[Admission]:
    if not v:
        return None
    return Admission(
        feasible=v["feasible"],
        deadline_ms=v["deadline_ms"],
        eta_ms=v["eta_ms"],
        margin_ms=v["margin_ms"],
        class_needed=v.get("class_needed"),
        bytes_over=v.get("bytes_over"),
        endangers=list(v.get("endangers") or []),
    )


class Client:
    """One agent's API at ``server`` (``http://127.0.0.1:7070``).

    ``token`` is a bearer token (``ferry token new``); ``ca_cert`` the CA
    file of an agent serving HTTPS; ``timeout`` seconds per request (a
    long poll gets its wait on top).
    """

    def __init__(
        self,
        server: str,
        token: Optional[str] = None,
        ca_cert: Optional[str] = None,
        timeout: float = 30.0,
    ):
        self.server = server.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._ssl = ssl.create_default_context(cafile=ca_cert) if ca_cert else None

    # ------------------------------------------------------------ HTTP --

    def _request(
        self,
        method: str,
        path: str,
        query: Optional[Dict[str, Any]] = None,
        body: Optional[Dict[str, Any]] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        q = {k: v for k, v in (query or {}).items() if v is not None}
        url = self.server + path + ("?" + urllib.parse.urlencode(q) if q else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(
                req, timeout=timeout or self.timeout, context=self._ssl
            ) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                msg = json.loads(text).get("error", text)
            except ValueError:
                msg = text
            raise FerryError(e.code, msg, method, path) from None
        except (urllib.error.URLError, OSError) as e:
            raise FerryError(0, str(getattr(e, "reason", e)), method, path) from None
        return json.loads(text) if text else None

    # ------------------------------------------------------------ sink --

    def resolve(
        self,
        path: str,
        wait: Optional[Duration] = None,
        lease: Optional[Duration] = None,
        full: bool = False,
    ) -> Resolution:
        """Where source path ``path`` is at this sink.

        With ``wait`` (at most 300 s), a long poll that answers as soon as
        it is local. With ``lease``, a ``local`` answer holds a reader
        lease on the version it names (see :meth:`lease`). With ``full``,
        only the full replica answers ``local``: under a weights-first
        publish the weights-only version (published first, answered
        without ``full``) is then still ``replicating``.
        """
        q = {
            "path": path,
            "wait": _duration(wait) if wait is not None else None,
            "lease": _duration(lease) if lease is not None else None,
            "profile": "full" if full else None,
        }
        extra = _seconds(wait) if wait is not None else 0.0
        v = self._request("GET", "/v1/resolve", q, timeout=self.timeout + extra)
        le = v.get("lease")
        return Resolution(
            state=v["state"],
            local_path=v.get("local_path"),
            url=v.get("url"),
            replica=v.get("replica"),
            lease=Lease(le["id"], le.get("holder", ""), le.get("expires_at", 0), le)
            if le
            else None,
            raw=v,
            profile=v.get("profile"),
        )

    def renew_lease(self, lease_id: str) -> Dict[str, Any]:
        """Renews a reader lease for its duration from now."""
        return self._request("POST", f"/v1/leases/{lease_id}/renew", body={})

    def release_lease(self, lease_id: str) -> Dict[str, Any]:
        """Releases a reader lease now."""
        return self._request("DELETE", f"/v1/leases/{lease_id}")

    @contextlib.contextmanager
    def lease(
        self,
        path: str,
        duration: Duration = "10m",
        wait: Optional[Duration] = None,
        full: bool = False,
    ) -> Iterator[Resolution]:
        """A reader lease on the replica of ``path`` for the ``with`` block
        (only the full replica with ``full``, as :meth:`resolve`).

        Yields the :class:`Resolution` (its ``location`` stays readable
        until the block ends, whatever a re-save publishes or a policy
        expires). The lease is renewed every third of its duration in a
        background thread and released at the end. Raises
        :class:`FerryError` (409 on a sink without version directories) or
        ``LookupError`` when the path is not local.
        """
        r = self.resolve(path, wait=wait, lease=duration, full=full)
        if r.state != "local" or r.lease is None:
            raise LookupError(f"{path} is not local at {self.server}: {r.state}")
        stop = threading.Event()
        every = max(_seconds(duration) / 3.0, 0.5)
        lease_id = r.lease.id

        def renew() -> None:
            while not stop.wait(every):
                try:
                    self.renew_lease(lease_id)
                except FerryError:
                    return

        t = threading.Thread(target=renew, name="ferry-lease-renew", daemon=True)
        t.start()
        try:
            yield r
        finally:
            stop.set()
            t.join(timeout=self.timeout)
            with contextlib.suppress(FerryError):
                self.release_lease(lease_id)

    def replica_events(
        self,
        job: Optional[str] = None,
        since: Optional[int] = None,
        reconnect: bool = True,
        idle_timeout: Optional[float] = None,
    ) -> Iterator[ReplicaEvent]:
        """Publish events (publish, replacement, removal) as they happen.

        Replays the log after event id ``since`` first. On a lost
        connection it reconnects with ``Last-Event-ID`` (so nothing is
        missed) unless ``reconnect`` is false. ``idle_timeout`` seconds
        without a byte (keep-alives count) ends the iteration.
        """
        last = since
        while True:
            q = {"job": job, "since": last}
            url = self.server + "/v1/replicas/events"
            qs = {k: v for k, v in q.items() if v is not None}
            if qs:
                url += "?" + urllib.parse.urlencode(qs)
            req = urllib.request.Request(url, method="GET")
            req.add_header("Accept", "text/event-stream")
            if self.token:
                req.add_header("Authorization", f"Bearer {self.token}")
            if last is not None:
                req.add_header("Last-Event-ID", str(last))
            try:
                with urllib.request.urlopen(
                    req, timeout=idle_timeout or self.timeout, context=self._ssl
                ) as r:
                    for ev in _sse(r):
                        if ev.id is not None:
                            last = ev.id
                        yield ev
            except urllib.error.HTTPError as e:
                raise FerryError(e.code, e.read().decode(errors="replace"), "GET", url) from None
            except TimeoutError:
                if idle_timeout is not None:
                    return
            except (urllib.error.URLError, OSError, ConnectionError):
                if not reconnect:
                    raise
                time.sleep(1.0)
                continue
            if not reconnect:
                return

    # ---------------------------------------------------------- source --

    def announce(
        self,
        job: str,
        step: int,
        path: str,
        expected_bytes: int = 0,
        deadline: Optional[Union[str, Duration]] = None,
        readers: Optional[int] = None,
    ) -> Dict[str, Any]:
        """Says a checkpoint is coming: its transfer is queued before its
        first byte. ``deadline`` is an RFC 3339 time or a duration after
        its commit; ``readers`` the eval ranks that will read its replica
        at once (1 to 10,000,000; an HDFS sink raises the replication of
        the files every rank reads to match). Returns the answer:
        ``selected``, ``transfer`` (with ``admission`` when a deadline was
        given, see :meth:`admission_of`) and ``outlook``."""
        body: Dict[str, Any] = {
            "job": job,
            "step": step,
            "path": path,
            "expected_bytes": expected_bytes,
        }
        if deadline is not None:
            body["deadline"] = deadline if isinstance(deadline, str) else _duration(deadline)
        if readers is not None:
            body["readers"] = readers
        return self._request("POST", "/v1/checkpoints/announce", body=body)

    def push(
        self,
        path: str,
        klass: Optional[str] = None,
        deadline: Optional[Union[str, Duration]] = None,
        readers: Optional[int] = None,
    ) -> Dict[str, Any]:
        """Queues the directory ``path`` (operator token); the transfer.
        ``deadline`` and ``readers`` as in :meth:`announce`."""
        body: Dict[str, Any] = {"path": path}
        if klass:
            body["class"] = klass
        if deadline is not None:
            body["deadline"] = deadline if isinstance(deadline, str) else _duration(deadline)
        if readers is not None:
            body["readers"] = readers
        return self._request("POST", "/v1/transfers", body=body)

    @staticmethod
    def admission_of(transfer: Dict[str, Any]) -> Optional[Admission]:
        """The admission answer in a transfer of :meth:`announce` or
        :meth:`push` (``None`` without a deadline)."""
        return _admission(transfer.get("admission"))

    def transfer(self, transfer_id: int) -> Dict[str, Any]:
        """One transfer with its progress and ranking."""
        return self._request("GET", f"/v1/transfers/{transfer_id}")

    def signal(
        self,
        job: str,
        kind: str = "loss_spike",
        severity: float = 0.9,
        step: Optional[int] = None,
        idempotency_key: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Sends a training signal (a loss spike raises the job's rank and
        makes its newest checkpoint urgent)."""
        body: Dict[str, Any] = {"job": job, "kind": kind, "severity": severity}
        if step is not None:
            body["step"] = step
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        return self._request("POST", "/v1/signals", body=body)

    def outlook(self, job: str) -> Outlook:
        """What job ``job`` can expect from its link now."""
        return _outlook(self._request("GET", f"/v1/jobs/{urllib.parse.quote(job, safe='')}/outlook"))


def _seconds(d: Duration) -> float:
    if not isinstance(d, str):
        return float(d)
    total, num = 0.0, ""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    i, s = 0, d.replace(" ", "")
    while i < len(s):
        if s[i].isdigit() or s[i] == ".":
            num += s[i]
            i += 1
            continue
        for u in ("ms", "s", "m", "h", "d"):
            if s.startswith(u, i):
                total += float(num or 0) * units[u]
                num, i = "", i + len(u)
                break
        else:
            raise ValueError(f"not a duration: {d!r}")
    return total + float(num or 0)


def _sse(r: Any) -> Iterator[ReplicaEvent]:
    """Server-sent events from a response, one per blank-line-ended block."""
    eid: Optional[int] = None
    kind = "message"
    data: List[str] = []
    for raw in r:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                try:
                    payload = json.loads("\n".join(data))
                except ValueError:
                    payload = {"text": "\n".join(data)}
                yield ReplicaEvent(eid if eid is not None else -1, kind, payload)
            kind, data = "message", []
            continue
        if line.startswith(":"):
            continue
        k, _, v = line.partition(":")
        v = v[1:] if v.startswith(" ") else v
        if k == "id":
            with contextlib.suppress(ValueError):
                eid = int(v)
        elif k == "event":
            kind = v
        elif k == "data":
            data.append(v)
