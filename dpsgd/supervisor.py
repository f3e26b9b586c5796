"""How the driver follows the peer processes it started: each peer reports every step it begins over
a Unix socket, so that when a run fails the driver can say which peer ended first, and at which step.

How it works: docs/guide/internals.md#supervisor.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import cast

ENV = "DPSGD_SUPERVISOR"
_FRAME = struct.Struct("<iq")  # rank, step
_FINISHED = -1  # the step value a peer sends when it ends normally
_ERROR = -2  # the step value of a peer's one-line error, followed by its length (_LENGTH) and its UTF-8 text
_LENGTH = struct.Struct("<I")
MAX_LINE = 4096  # bytes of an error line the driver keeps


class Supervisor(contextlib.AbstractContextManager):
    """The driver's record of its peers: the last step each began and when each one's process ended."""

    def __init__(self):
        self._dir = tempfile.mkdtemp(prefix="dpsgd-")  # mode 0700: only this user can connect
        self.path = os.path.join(self._dir, "peers.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(256)
        self.steps: dict[int, int] = {}  # rank -> the last step it began
        self.ended: dict[int, float] = {}  # rank -> time.time() its connection closed without `finished`
        self.finished: set[int] = set()
        # rank -> (time.time() it came, the one line a peer sent as it failed): heard even when no file can be written
        self.errors: dict[int, tuple[float, str]] = {}
        self.last_progress: float | None = None  # time.monotonic() of the newest step heard (dpsgd.backends.watchdog)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dpsgd-supervisor", daemon=True)
        self._thread.start()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                if key.fileobj is self._server:
                    conn, _ = self._server.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, data=[b"", None])  # [unparsed bytes, its rank]
                    continue
                conn, state = cast(socket.socket, key.fileobj), key.data
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                now = time.time()
                state[0] += data
                while len(state[0]) >= _FRAME.size:
                    rank, step = _FRAME.unpack_from(state[0])
                    used = _FRAME.size
                    if step == _ERROR:  # the frame, the line's length, the line: wait until all of it came
                        if len(state[0]) < used + _LENGTH.size:
                            break
                        (length,) = _LENGTH.unpack_from(state[0], used)
                        if len(state[0]) < used + _LENGTH.size + length:
                            break
                        text = state[0][used + _LENGTH.size : used + _LENGTH.size + length]
                        self.errors.setdefault(rank, (now, text.decode(errors="replace")))
                        used += _LENGTH.size + length
                    elif step == _FINISHED:
                        self.finished.add(rank)
                    else:
                        self.steps[rank] = step
                        self.last_progress = time.monotonic()
                    state[0], state[1] = state[0][used:], rank
                if not data:  # the peer's process closed the connection: it ended
                    if state[1] is not None and state[1] not in self.finished:
                        self.ended.setdefault(state[1], now)
                    sel.unregister(conn)
                    conn.close()
        for key in list(sel.get_map().values()):
            if key.fileobj is not self._server:
                cast(socket.socket, key.fileobj).close()
        sel.close()


_conn: tuple[socket.socket, int] | None = None  # this peer's connection to the driver, and its rank
_lock = threading.Lock()
# steps of peers that are threads of this process (backend=local), for the driver's watchdog there
in_process_steps: dict[int, int] = {}
in_process_progress: float | None = None  # time.monotonic() of the newest one


def _connection(rank: int) -> tuple[socket.socket, int] | None:
    """This peer's connection to the driver (made at the first report; call with _lock held), or None where no
    driver listens."""
    global _conn
    path = os.environ.get(ENV)
    if _conn is None and path:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            os.environ.pop(ENV, None)  # no driver listening: stop trying
            return None
        _conn = (sock, rank)
    return _conn


def report_step(rank: int, step: int) -> None:
    """Tell the driver (if it started this process, or is this process) that peer `rank` begins step `step`."""
    global in_process_progress
    in_process_steps[rank], in_process_progress = step, time.monotonic()
    if not os.environ.get(ENV):
        return
    with _lock:
        conn = _connection(rank)
        if conn is not None:
            _send(conn, step)


def report_error(rank: int, line: str) -> None:
    """Tell the driver (if it started this process) the one line peer `rank` fails with: the driver names it even
    where the peer can write no file (a full disk, a read-only folder)."""
    text = line.encode()[:MAX_LINE]
    with _lock:
        conn = _connection(rank)
        if conn is None:
            return
        try:
            conn[0].sendall(_FRAME.pack(rank, _ERROR) + _LENGTH.pack(len(text)) + text)
        except OSError:
            pass  # the driver is gone: the peer's own log has the line


def report_finished() -> None:
    """This peer ended normally: the closing of its connection is not a failure."""
    global _conn
    with _lock:
        if _conn is not None:
            _send(_conn, _FINISHED)
            with contextlib.suppress(OSError):
                _conn[0].close()
            _conn = None


def _send(conn: tuple[socket.socket, int], step: int) -> None:
    try:
        conn[0].sendall(_FRAME.pack(conn[1], step))
    except OSError:  # the driver is gone: training goes on, unsupervised
        os.environ.pop(ENV, None)
