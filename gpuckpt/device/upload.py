"""Loads to a device as a pipeline: readers fill staging, a copy stream moves it in.

Reader threads each take a staging buffer (blocking while the run's budget is
in use: the pipeline's depth), read and check a chunk into it, and hand it to
a :class:`CopyQueue`, which queues the host-to-device copy on the back end's
own stream at once and returns: the reader goes on with its next chunk while
the copy runs. One retiring worker waits for the copies in the order they
were queued and gives each buffer back to the pool when its copy is done, so
buffers are reused for the next chunks and never overwritten while a copy
still reads them. Disk (or page cache) and the bus then work at the same
time, and the slower of the two sets the pace.

Nothing here knows of files or checksums: a reader fills
:attr:`~gpuckpt.device.arrays.StagedIn.box` as it likes. A chunk that fails
its check is never handed over, so its bytes never reach the device.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from gpuckpt.device.arrays import StagedIn
from gpuckpt.device.backend import Ticket
from gpuckpt.runtime.workers import Workers

__all__ = ["CopyQueue"]


class CopyQueue:
    """The host-to-device copies of one load, started in order and retired behind the readers.

    Call order: readers (any number of threads) call :meth:`put` with each
    filled box; once every reader has ended, :meth:`close` (always, also after
    a reader failed) waits for the copies still queued, gives every buffer
    back, and raises the first copy error. After a copy failed, :meth:`put`
    raises that error, so readers stop early.

    Copies are retired by one of gpuckpt's own worker threads (one per queue,
    so in the order they were queued); where no thread can be started any more
    (a load from an exit handler) the reader retires its copy itself, waiting
    for it, and the load still completes.
    """

    def __init__(self, name: str = "gpuckpt-upload") -> None:
        self._retirer = Workers(1, name)
        self._retiring: list[Future[None]] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._closed = False
        #: copies started, and the most queued and not yet retired at once (a record for tests)
        self.started = 0
        self.max_pending = 0
        self._pending = 0

    def put(self, staged: StagedIn) -> None:
        """Start moving the filled ``staged`` box into its array; its buffer is given back once there."""
        with self._lock:
            error, closed = self._error, self._closed
        if error is not None or closed:
            staged.release()
            if error is not None:
                raise error
            raise RuntimeError("CopyQueue.put() after close()")
        try:
            ticket = staged.start()
        except BaseException:
            staged.release()
            raise
        with self._lock:
            self.started += 1
            self._pending += 1
            self.max_pending = max(self.max_pending, self._pending)
        # submitted in the order the copies were queued (one retiring thread takes them in
        # that order); not under self._lock: without a thread, _retire runs right here
        with self._submit_lock:
            future = self._retirer.submit(self._retire, ticket, staged)
            with self._lock:
                self._retiring.append(future)

    def _retire(self, ticket: Ticket, staged: StagedIn) -> None:
        try:
            ticket.wait()
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
        finally:
            staged.release()
            with self._lock:
                self._pending -= 1

    @property
    def pending(self) -> int:
        """Copies queued and not yet retired."""
        with self._lock:
            return self._pending

    def close(self) -> None:
        """Wait for every queued copy, give back every buffer, raise the first copy error."""
        with self._lock:
            self._closed = True
            retiring, self._retiring = self._retiring, []
        for future in retiring:
            future.result()  # _retire records errors instead of raising them
        self._retirer.shutdown(wait=False)
        if self._error is not None:
            raise self._error
