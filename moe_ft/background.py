"""One background thread that handles submitted items in order, with a sticky error.

The snapshot engine, the durable-tier writer and the replication sender each move bytes off the training
thread the same way: the training thread submits an item and returns at once; one daemon thread handles the
items in submission order; the first exception stops the handling of later items (they are drained, not
handled) and is kept, so that the training thread sees it on its next call (``raise_if_failed``), at
``drain`` or at ``close``. The thread is a daemon: a rank that exits while an item waits on a peer or on a
publish timeout is not held at interpreter exit (``concurrent.futures`` joins its workers at exit, which is
why it is not used here).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

_STOP = object()


class BackgroundWorker(Generic[T]):
    """``handle(item)`` for every submitted item, in order, on one daemon thread named ``name``.

    ``setup()`` runs first on that thread; ``after(item, error)`` runs after every item, handled or skipped
    (``error`` is the worker's error so far, ``None`` while it is healthy); ``describe(error)`` gives the
    message of the ``RuntimeError`` the training thread gets for the kept error."""

    def __init__(self, name: str, handle: Callable[[T], None], *, describe: Callable[[BaseException], str],
                 setup: Callable[[], None] | None = None,
                 after: Callable[[T, BaseException | None], None] | None = None) -> None:
        self.name = name
        self._handle, self._describe, self._setup, self._after = handle, describe, setup, after
        self._queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        """The first exception an item raised (later items are skipped), else ``None``."""
        self._discard = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- training thread ---------------------------------------------------------------------------------
    def submit(self, item: T) -> None:
        """Queue ``item`` (returns at once)."""
        self._queue.put(item)

    def has_pending(self) -> bool:
        """Whether submitted items wait to be handled (the one being handled not counted)."""
        return not self._queue.empty()

    def drain(self) -> None:
        """Block until every submitted item is handled or skipped, then raise the kept error, if any."""
        self._queue.join()
        self.raise_if_failed()

    def close(self, timeout: float | None = None, *, discard: bool = False) -> None:
        """Handle what is queued (``discard``: skip it, as after an error: a failed attempt's work, which must
        not reach anyone once the next attempt began), then stop the thread (waiting at most ``timeout``
        seconds for it; an item being handled is finished). Raises nothing: call :meth:`raise_if_failed`
        after it to surface the kept error."""
        if not self._thread.is_alive():
            return
        if discard:
            self._discard = True
        self._queue.put(_STOP)
        self._thread.join(timeout=timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(self._describe(self.error)) from self.error

    # -- worker thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._setup is not None:
            try:
                self._setup()
            except BaseException as exc:  # every item is then skipped: the thread lives on to drain them
                self._fail(exc)
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            try:
                if self.error is None and not self._discard:
                    self._handle(item)
            except BaseException as exc:  # kept, and raised on the training thread's next call
                self._fail(exc)
            try:
                if self._after is not None:
                    self._after(item, self.error)
            except BaseException as exc:  # as a handling error: a thread that died here would leave every
                self._fail(exc)  # later drain() waiting for items nobody takes
            finally:
                self._queue.task_done()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        logger.error("%s: %r", self.name, exc)
