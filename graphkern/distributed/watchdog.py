"""The watchdog: a call stuck in its collectives becomes an error on every rank, with a flight record.

MLX's ring backend has no timeout: a rank whose peer never enters a collective waits forever, one
core at 100%. With ``timeout=`` on ``gk.compile`` or ``gk.wrap``, each call that may communicate
is *watched*: it enters this process's flight record (the last calls, in the spirit of PyTorch's
NCCL flight recorder: sequence number, the call, its collectives, entered / completed / failed)
and a watchdog thread checks its deadline. When a call overruns, the watchdog aborts the job:

1. it writes the reason (``abort.json``, the first rank to write it wins) and this rank's flight
   record into the job's flight folder, ``graphkern-flight-<token>`` in ``GRAPHKERN_FLIGHT_DIR``
   (else the temporary directory), where ``<token>`` is a random number rank 0 drew and sent
   with the job's first agreement: every rank of the job shares it and no other job does (a
   stale abort of an earlier job on the same hostfile is never read), and an abort record older
   than this process's job is ignored all the same. A job that ends without an abort removes its
   folder; an aborted job's stays for the post-mortem;
2. it shuts down this process's ring sockets (those on the hostfile's ports), as NCCL's
   ``ncclCommAbort`` does: the stuck evaluation raises, and so do the peers' collectives;
3. every rank's watchdog sees the reason within a poll, writes its own record and aborts too; a
   call in progress raises :class:`CollectiveTimeout` (or :class:`JobAborted` when a rank failed
   while running), and so does every later watched call, naming the rank and the last calls each
   rank entered.

After an abort the group cannot communicate again (as after ``ncclCommAbort``): end the job. MLX's
ring fails the transfers pending when a connection drops, so a call waiting in a collective
raises; a transfer MLX queues after that waits forever, though, and a call still inside MLX a few
seconds after the abort makes the watchdog print the report and end the process with status 1,
as PyTorch's NCCL watchdog does by default.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from ..nodes import Status
from .agreement import GroupError

__all__ = ["CollectiveTimeout", "FlightRecorder", "Job", "JobAborted", "ring_connections"]

_POLL = 0.05  # seconds between the watchdog's looks at deadlines and at the flight folder
_GRACE = 2.0  # seconds a raising rank waits for the others' flight records
_RELEASE = _GRACE + 4.0  # seconds after an abort that a call may still be inside MLX
_RECORDS = 64  # calls kept in a flight record
_SHOWN = 4  # collectives kept per call in a written record
_OPERATION = "run a graphkern compiled graph across ranks"


class JobAborted(GroupError):
    """The job was aborted: a rank's watchdog fired (see :class:`CollectiveTimeout`), a rank failed
    while running, or a connection was lost. ``rank`` is the rank that aborted (None when a
    connection was lost), ``reason`` what happened, ``records`` the flight record of every rank
    that answered (rank -> its last calls, oldest first)."""

    def __init__(self, description: str, status: Status, *, rank: int | None,
                 reason: dict[str, Any], records: dict[int, list[dict[str, Any]]]) -> None:
        super().__init__(description, status, rank=rank, node=reason.get("node"), operation=_OPERATION)
        self.reason = reason
        self.records = records

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_aborted, (type(self), self.description, self.status, self.rank, self.reason,
                                   self.records))


class CollectiveTimeout(JobAborted):
    """A rank waited longer than its ``timeout=`` for a call's collectives."""


def _rebuild_aborted(cls: type[JobAborted], description: str, status: Status, rank: int | None,
                     reason: dict[str, Any], records: dict[int, list[dict[str, Any]]]) -> JobAborted:
    return cls(description, status, rank=rank, reason=reason, records=records)


# ----------------------------------------------------------------------------- flight record


class FlightRecorder:
    """The last calls this process entered, oldest first.

    >>> flight = FlightRecorder()
    >>> entry = flight.enter("Model(int32[1, 3])", ("all_sum(sum) float32[1, 3, 64] ...",))
    >>> flight.finish(entry, "completed")
    >>> [(e["seq"], e["state"]) for e in flight.snapshot()]
    [(0, 'completed')]
    """

    def __init__(self, size: int = _RECORDS) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=size)
        self.seq = 0

    def enter(self, call: str, collectives: tuple[str, ...]) -> dict[str, Any]:
        entry = {"seq": self.seq, "call": call, "collectives": collectives, "state": "entered",
                 "entered": time.time(), "finished": None}
        self.seq += 1
        self.entries.append(entry)
        return entry

    @staticmethod
    def finish(entry: dict[str, Any], state: str) -> None:
        entry["state"], entry["finished"] = state, time.time()

    def snapshot(self) -> list[dict[str, Any]]:
        """The record as JSON-ready dicts (each call's collectives cut to the first few)."""
        out = []
        for entry in list(self.entries):
            collectives = entry["collectives"]
            out.append({**entry, "collectives": list(collectives[:_SHOWN]), "count": len(collectives)})
        return out


# ----------------------------------------------------------------------------- the flight folder


def _hostfile_text() -> str | None:
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


class _Folder:
    """The job's flight folder: the abort reason and each rank's record, as JSON files."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.abort_path = os.path.join(path, "abort.json")

    @classmethod
    def of_job(cls, token: int) -> _Folder:
        """The folder of the job whose ranks agreed on ``token``, made if new."""
        base = os.environ.get("GRAPHKERN_FLIGHT_DIR") or tempfile.gettempdir()
        folder = cls(os.path.join(base, f"graphkern-flight-{token:016x}"))
        with contextlib.suppress(OSError):
            os.makedirs(folder.path, exist_ok=True)
        return folder

    def _write(self, name: str, doc: Any) -> str:
        os.makedirs(self.path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gk-", suffix=".json", dir=self.path)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        return tmp

    def claim(self, reason: dict[str, Any]) -> dict[str, Any]:
        """Write ``reason`` unless a rank wrote one first; the reason that stands."""
        try:
            tmp = self._write("abort", reason)
        except OSError:
            return reason
        try:
            os.link(tmp, self.abort_path)  # atomic and exclusive: the first rank wins
        except FileExistsError:
            return self.reason() or reason
        except OSError:
            return reason
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return reason

    def reason(self) -> dict[str, Any] | None:
        try:
            with open(self.abort_path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def write_record(self, rank: int, entries: list[dict[str, Any]]) -> None:
        with contextlib.suppress(OSError):
            os.replace(self._write("record", entries), os.path.join(self.path, f"rank{rank}.json"))

    def records(self, size: int, wait: float) -> dict[int, list[dict[str, Any]]]:
        """Every rank's record that arrives within ``wait`` seconds."""
        deadline = time.monotonic() + wait
        found: dict[int, list[dict[str, Any]]] = {}
        while True:
            for rank in range(size):
                if rank in found:
                    continue
                try:
                    with open(os.path.join(self.path, f"rank{rank}.json"), encoding="utf-8") as f:
                        found[rank] = json.load(f)
                except (OSError, ValueError):
                    pass
            if len(found) == size or time.monotonic() > deadline:
                return found
            time.sleep(_POLL / 2)


# ----------------------------------------------------------------------------- the ring's sockets


def _ring_ports() -> set[int]:
    """The ports of ``MLX_HOSTFILE`` (``["127.0.0.1:5000"]`` per rank, or ``{"ips": [...]}``)."""
    text = _hostfile_text()
    ports: set[int] = set()
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return ports

    def walk(value: Any) -> None:
        if isinstance(value, str) and ":" in value:
            with contextlib.suppress(ValueError):
                ports.add(int(value.rsplit(":", 1)[1]))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(doc)
    return ports


def _socket_fds() -> list[int]:
    try:
        names = os.listdir("/proc/self/fd")
        fds = [int(n) for n in names]
    except OSError:  # no /proc (macOS): look at the low descriptors
        fds = list(range(min(os.sysconf("SC_OPEN_MAX"), 4096)))
    found = []
    for fd in fds:
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                found.append(fd)
        except OSError:
            continue
    return found


def ring_connections(ports: set[int] | None = None) -> Iterator[socket.socket]:
    """This process's TCP connections on one of ``ports`` (default: ``MLX_HOSTFILE``'s), the ring's
    connections to its peers, each as a socket on a duplicate of its descriptor (closed when the
    next one is asked for)."""
    ports = _ring_ports() if ports is None else ports
    if not ports:
        return
    for fd in _socket_fds():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            mine = sock.getsockname()[1]
            try:
                theirs = sock.getpeername()[1]
            except OSError:  # not connected (a listening socket)
                continue
            if mine in ports or theirs in ports:
                yield sock
        except OSError:
            continue
        finally:
            sock.close()


def _abort_ring(ports: set[int]) -> int:
    """Shut down every ring connection of this process (see ``ring_connections``); how many."""
    count = 0
    for sock in ring_connections(ports):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
    return count


# ----------------------------------------------------------------------------- the job


class Job:
    """This process's part of a distributed job: its flight record, the flight folder, the
    watchdog thread and whether the job was aborted. One per (rank, group size).

    >>> job = Job(0, 2)
    >>> with job.watch(60.0, "f(float32[2])", ()):
    ...     pass
    >>> job.flight.snapshot()[0]["state"]
    'completed'
    """

    _jobs: dict[tuple[int, int], Job] = {}
    _jobs_lock = threading.Lock()

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.flight = FlightRecorder()
        self.started = time.time()  # an abort record written before this is an earlier job's
        #: this rank's proposal for the job's token (rank 0's is the one every rank joins)
        self.proposal = int.from_bytes(os.urandom(8), "little") or 1
        self.token: int | None = None
        self.folder: _Folder | None = None  # known once the ranks agreed on the token (join)
        self.ports = _ring_ports()
        self.reason: dict[str, Any] | None = None
        self._inflight: dict[int, tuple[float, float, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stuck_after = 0.0  # when a call still inside MLX after an abort ends the process

    def join(self, token: int) -> None:
        """Take ``token`` (rank 0's proposal, from the job's first agreement) as the job's: its
        flight folder is named after it. Later tokens are ignored, so is 0 (no token)."""
        if self.token is not None or not token:
            return
        self.token = token
        self.folder = _Folder.of_job(token)
        atexit.register(self.end)

    def end(self) -> None:
        """The job ends here: remove its flight folder unless it was aborted (then the folder keeps
        the reason and the ranks' records)."""
        folder = self.folder
        if folder is not None and self.reason is None and not os.path.exists(folder.abort_path):
            shutil.rmtree(folder.path, ignore_errors=True)

    @classmethod
    def of(cls, group: Any) -> Job:
        key = (group.rank(), group.size())
        with cls._jobs_lock:
            job = cls._jobs.get(key)
            if job is None:
                job = cls._jobs[key] = cls(*key)
            return job

    @contextlib.contextmanager
    def watch(self, timeout: float, call: str, collectives: tuple[str, ...]) -> Iterator[None]:
        """Run the body as one watched call (see the module's text); raises ``JobAborted`` when
        the job is or gets aborted."""
        if self.reason is not None:  # the watchdog thread saw an abort (this rank's or another's)
            raise self.error(None)  # type: ignore[misc]
        entry = self.flight.enter(call, collectives)
        token = id(entry)
        with self._lock:
            self._inflight[token] = (time.monotonic() + timeout, timeout, entry)
        self._start()
        try:
            yield
        except BaseException as exc:
            self.flight.finish(entry, "failed")
            error = self.error(exc) if isinstance(exc, Exception) else None
            if error is not None:
                raise error from exc
            raise
        else:
            self.flight.finish(entry, "completed")
        finally:
            with self._lock:
                self._inflight.pop(token, None)

    def fail(self, rank_error: Any) -> None:
        """This rank failed while running (``rank_error``, a ``GraphError``): abort the job so
        no rank waits for collectives this one will never enter."""
        self._abort({"kind": "failure", "rank": self.rank, "node": getattr(rank_error, "node", None),
                     "status": int(getattr(rank_error, "status", Status.RUNTIME_ERROR)),
                     "message": str(rank_error), "time": time.time()})

    def error(self, cause: BaseException | None) -> JobAborted | None:
        """The error of an aborted job (None when it was not, and ``cause`` is not a lost
        connection), with every rank's record that arrives in time."""
        reason = self.reason or self._peer_reason()
        if reason is None:
            if cause is None or "[ring]" not in str(cause):
                return None
            reason = {"kind": "lost", "rank": None, "message": str(cause), "time": time.time()}
        records = (self.folder.records(self.size, _GRACE) if self.folder is not None
                   else {self.rank: self.flight.snapshot()})
        records.setdefault(self.rank, self.flight.snapshot())
        return _aborted(reason, records, self.size)

    # ------------------------------------------------------------------ the watchdog thread

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="graphkern-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_POLL)
            with self._lock:
                if self.folder is None and not self._inflight:  # nothing to watch until the next call
                    self._thread = None
                    return
            now = time.monotonic()
            if self.reason is not None:
                self._end_if_stuck(now)
                continue
            with self._lock:
                late = [(timeout, entry) for deadline, timeout, entry in self._inflight.values()
                        if now > deadline]
            if late:
                timeout, entry = late[0]
                self._abort({"kind": "timeout", "rank": self.rank, "seq": entry["seq"],
                             "call": entry["call"], "timeout": timeout, "time": time.time()})
            else:
                self._peer_reason()

    def _end_if_stuck(self, now: float) -> None:
        """A call still inside MLX well after the abort will never come back (MLX's ring fails
        the transfers pending when a connection drops, but one queued after that waits forever):
        print the report and end the process, as PyTorch's NCCL watchdog does."""
        with self._lock:
            stuck = [entry for _, _, entry in self._inflight.values() if entry["state"] == "entered"]
        if not stuck or now < self._stuck_after or self.reason is None:
            return
        report = self.error(None)
        sys.stderr.write(f"graphkern watchdog: {report}\ngraphkern watchdog: call #{stuck[0]['seq']} is "
                         f"still waiting inside MLX after the abort; ending the process\n")
        sys.stderr.flush()
        os._exit(1)

    def _peer_reason(self) -> dict[str, Any] | None:
        """Another rank's abort, if the flight folder holds one: answer it (once)."""
        if self.reason is not None or self.folder is None:
            return self.reason
        reason = self.folder.reason()
        written = reason.get("time") if reason is not None else None
        if reason is not None and isinstance(written, (int, float)) and written >= self.started:
            self._abort(reason)
        return self.reason

    def _abort(self, reason: dict[str, Any]) -> None:
        with self._lock:
            if self.reason is not None:
                return
            if self.folder is not None:
                reason = self.folder.claim(reason)
            self.reason = reason
            self._stuck_after = time.monotonic() + _RELEASE
        if self.folder is not None:
            self.folder.write_record(self.rank, self.flight.snapshot())
        _abort_ring(self.ports)  # the peers' transfers fail at once rather than at their timeout


# ----------------------------------------------------------------------------- reports


def _ago(then: Any, now: float) -> str:
    return f"{now - then:.2f} s before the abort" if isinstance(then, (int, float)) else "at an unknown time"


def _describe(rank: int, entries: list[dict[str, Any]], reason: dict[str, Any]) -> str:
    """One rank's last call, for the report."""
    if not entries:
        return f"rank {rank}: entered no watched call"
    last = entries[-1]
    now = float(reason.get("time") or time.time())
    state = last.get("state")
    if state == "entered":
        when = f"entered {_ago(last.get('entered'), now)}, never finished"
    elif state == "completed":
        when = f"completed {_ago(last.get('finished'), now)}"
    else:
        when = f"{state} {_ago(last.get('finished'), now)}"
    shown = last.get("collectives") or []
    count = last.get("count", len(shown))
    what = f"{count} collectives, the first {shown[0]}" if shown else "no collectives"
    line = f"rank {rank}: #{last['seq']} {last['call']} {when} ({what})"
    seq = reason.get("seq")
    if isinstance(seq, int) and last["seq"] < seq:
        line += f"; it never entered #{seq}"
    return line


def _aborted(reason: dict[str, Any], records: dict[int, list[dict[str, Any]]], size: int) -> JobAborted:
    kind, who = reason.get("kind"), reason.get("rank")
    cls: type[JobAborted]
    if kind == "timeout":
        head = (f"rank {who} waited over {reason.get('timeout')} s for the collectives of call "
                f"#{reason.get('seq')} ({reason.get('call')}); the job is aborted")
        status, cls = Status.RUNTIME_ERROR, CollectiveTimeout
    elif kind == "failure":
        head = f"rank {who} failed while running and aborted the job: {reason.get('message')}"
        status, cls = Status(reason.get("status") or Status.RUNTIME_ERROR), JobAborted
    else:
        head = f"a connection between ranks was lost ({reason.get('message')}); the job is aborted"
        status, cls = Status.RUNTIME_ERROR, JobAborted
    lines = [_describe(r, records[r], reason) if r in records else f"rank {r}: no flight record"
             for r in range(size)]
    return cls(f"{head}. The last call each rank entered: " + "; ".join(lines), status,
               rank=who if isinstance(who, int) else None, reason=reason, records=records)
