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
   than this process's job is ignored all the same. The folder is removed only when every rank
   of the job ended cleanly (no abort, its last watched call completed; each clean rank leaves
   an ``ended<rank>`` mark, the last one removes the folder); after any other end (an abort, a
   rank killed or crashed, a lost connection) it stays for the post-mortem. Under a launcher
   that sets ``GRAPHKERN_FLIGHT_KEEP`` (``run_ranks`` does: it alone sees every rank's exit
   status) no rank removes it;
2. it shuts down this process's ring sockets (those on the hostfile's ports), as NCCL's
   ``ncclCommAbort`` does: the stuck evaluation raises, and so do the peers' collectives;
3. every rank's watchdog sees the reason within a poll, writes its own record and aborts too; a
   call in progress raises :class:`CollectiveTimeout` (or :class:`JobAborted` when a rank failed
   while running), and so does every later watched call, naming the rank and the last calls each
   rank entered.

A rank whose call fails because a ring connection dropped (a peer killed or crashed) aborts the
job the same way; the ranks that write no flight record within the grace period are the ones
that died, and the error names them and when the connection was lost.

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

__all__ = ["KEEP_ENV", "CollectiveTimeout", "FlightRecorder", "Job", "JobAborted", "ring_connections"]

_POLL = 0.05  # seconds between the watchdog's looks at deadlines and at the flight folder
_GRACE = 2.0  # seconds a raising rank waits for the others' flight records
_RELEASE = _GRACE + 4.0  # seconds after an abort that a call may still be inside MLX
_RECORDS = 64  # calls kept in a flight record
_SHOWN = 4  # collectives kept per call in a written record
_OPERATION = "run a graphkern compiled graph across ranks"
#: set (to anything but "" or "0") by a launcher that removes the flight folder itself
KEEP_ENV = "GRAPHKERN_FLIGHT_KEEP"


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


def _launcher_keeps() -> bool:
    """A launcher that sees every rank's exit status removes the flight folder itself."""
    return os.environ.get(KEEP_ENV, "") not in ("", "0")


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

    def mark_ended(self, rank: int) -> None:
        """Leave the mark of a rank that ended cleanly (in the folder as it is: never made anew)."""
        with contextlib.suppress(OSError), open(os.path.join(self.path, f"ended{rank}"), "w") as f:
            f.write(f"{time.time()}\n")

    def all_ended(self, size: int) -> bool:
        """Every rank of ``size`` ended cleanly and none aborted."""
        return not os.path.exists(self.abort_path) and all(
            os.path.exists(os.path.join(self.path, f"ended{rank}")) for rank in range(size))

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
        self._ended = False

    def join(self, token: int) -> None:
        """Take ``token`` (rank 0's proposal, from the job's first agreement) as the job's: its
        flight folder is named after it. Later tokens are ignored, so is 0 (no token)."""
        if self.token is not None or not token:
            return
        self.token = token
        self.folder = _Folder.of_job(token)
        atexit.register(self.end)

    def end(self) -> None:
        """The job ends here for this rank (at exit, once): a clean end leaves its mark and the
        last rank to end cleanly removes the flight folder; any other end writes this rank's
        record there, so the folder stays with the reason and the records for the post-mortem."""
        folder = self.folder
        if folder is None or self._ended:
            return
        self._ended = True
        if not self.clean():
            folder.write_record(self.rank, self.flight.snapshot())
        elif not _launcher_keeps():
            folder.mark_ended(self.rank)
            if folder.all_ended(self.size):
                shutil.rmtree(folder.path, ignore_errors=True)

    def clean(self) -> bool:
        """This rank's part ended cleanly: no abort (its own or in the folder) and its last watched
        call completed. (An exit status is the launcher's to see: ``run_ranks`` keeps the folder
        of a job whose ranks did not all exit 0.)"""
        entries = list(self.flight.entries)
        folder = self.folder
        aborted = self.reason is not None or (folder is not None and os.path.exists(folder.abort_path))
        return not aborted and (not entries or entries[-1]["state"] == "completed")

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
            error = self.error(exc, entry) if isinstance(exc, Exception) else None
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

    def error(self, cause: BaseException | None, entry: dict[str, Any] | None = None) -> JobAborted | None:
        """The error of an aborted job (None when it was not, and ``cause`` is not a lost
        connection), with every rank's record that arrives in time. A lost connection (``cause``
        from MLX's ring, in the watched call ``entry``) aborts the job here, so the other ranks
        stop too and the folder keeps the reason."""
        reason = self.reason or self._peer_reason()
        if reason is None:
            if cause is None or "[ring]" not in str(cause):
                return None
            self._abort(_lost(self.rank, cause, entry))
            reason = self.reason
            assert reason is not None
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


def _lost(rank: int, cause: BaseException, entry: dict[str, Any] | None) -> dict[str, Any]:
    """The reason of a job whose ring connection this rank lost in the watched call ``entry``."""
    reason: dict[str, Any] = {"kind": "lost", "rank": None, "by": rank, "message": str(cause),
                              "time": time.time()}
    if entry is not None:
        reason.update(seq=entry["seq"], call=entry["call"], entered=entry["entered"])
    return reason


def _ago(then: Any, now: float) -> str:
    """When ``then`` was, against the abort at ``now``: never a negative number of seconds.

    >>> _ago(9.5, 10.0), _ago(10.25, 10.0), _ago(10.001, 10.0), _ago(None, 10.0)
    ('0.50 s before the abort', '0.25 s after the abort', 'at the abort', 'at an unknown time')
    """
    if not isinstance(then, (int, float)):
        return "at an unknown time"
    seconds = now - then
    if abs(seconds) < 0.005:
        return "at the abort"
    return f"{abs(seconds):.2f} s {'before' if seconds > 0 else 'after'} the abort"


def _clock(then: Any) -> str:
    """``14:03:07.25``: a time of day on this machine's clock."""
    if not isinstance(then, (int, float)):
        return "an unknown time"
    return time.strftime("%H:%M:%S", time.localtime(then)) + f".{int(then * 100) % 100:02d}"


def _ranks(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 1 and 3``, ``ranks 0, 1 and 3``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _lost_head(reason: dict[str, Any], records: dict[int, list[dict[str, Any]]], size: int) -> str:
    """Which ranks died (those that left no flight record) and when the connection was lost."""
    when = f"rank {reason.get('by')} lost its ring connection at {_clock(reason.get('time'))}"
    entered, now = reason.get("entered"), reason.get("time")
    if isinstance(entered, (int, float)) and isinstance(now, (int, float)):
        when += f", {max(0.0, now - entered):.2f} s into call #{reason.get('seq')} {reason.get('call')}"
    gone = [rank for rank in range(size) if rank not in records]
    if not gone:
        return f"a connection between ranks was lost ({reason.get('message')}): {when}; the job is aborted"
    they = "it" if len(gone) == 1 else "they"
    return (f"{_ranks(gone)} died (killed or crashed: {they} left no flight record); {when}; "
            f"the job is aborted")


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
        head = _lost_head(reason, records, size)
        status, cls = Status.RUNTIME_ERROR, JobAborted
    lines = [_describe(r, records[r], reason) if r in records else f"rank {r}: no flight record (its "
             f"process ended or hung before writing one)" for r in range(size)]
    return cls(f"{head}. The last call each rank entered: " + "; ".join(lines), status,
               rank=who if isinstance(who, int) else None, reason=reason, records=records)
