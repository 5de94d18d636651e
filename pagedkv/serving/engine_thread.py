"""``EngineThread``: an ``Engine`` on its own thread, the one thread that touches MLX.

MLX streams are thread-local, so the model, the pool and every array live on the
owner thread: ``build`` (which loads the model and makes the engine) runs there, and so
does every step. Other threads (HTTP handlers) only talk to it through a command
queue: ``submit`` a request, ``abort`` one, ``stop``. Commands are applied between
steps, so an abort takes effect before the next step and the aborted row's pages go
back at once. When nothing is queued or running the thread sleeps on the queue.

If a step raises, every request in flight ends with finish reason "error", all pages
are released and the thread keeps serving (``errors`` counts such steps).
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from typing import Callable

from pagedkv.serving.engine import Delta, Engine, GenerationRequest

log = logging.getLogger("pagedkv.serve")

_STOP = object()


class EngineThread:
    def __init__(self, build: Callable[[], Engine]) -> None:
        self._build = build
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self.engine: Engine | None = None
        self.build_error: BaseException | None = None
        self._finished = threading.Event()  # its work is over: built nothing, or stopped
        self._closing = threading.Lock()  # guards ``_closed``: no command is queued once it is set
        self._closed = False  # the work is over; ``_finished`` follows once every request has ended
        self._unread: list = []  # commands read in one batch with the stop, after it
        self.errors = 0

    def start(self, timeout: float | None = None) -> Engine:
        """Start the thread and wait until ``build`` returned; re-raises its error."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not start in time")
        if self.build_error is not None:
            raise self.build_error
        return self.engine

    @property
    def alive(self) -> bool:
        return self.engine is not None and not self._finished.is_set()

    def submit(self, req: GenerationRequest) -> None:
        """Queue ``req``; a request the engine refuses gets a last ``Delta`` with
        finish reason "error" and the message, as does one submitted once the engine's
        work is over (stopped, or never built): it used to wait in the queue for good."""
        with self._closing:
            if not self._closed:
                self._commands.put(("add", req))
                return
        _refuse(req, "the engine has stopped")

    def abort(self, rid: str) -> None:
        with self._closing:
            if not self._closed:  # (after it, every request has ended)
                self._commands.put(("abort", rid))

    def stop(self, timeout: float | None = 30) -> None:
        """Abort everything, release every page and end the engine's work."""
        if self._thread.is_alive() and not self._finished.is_set():
            self._commands.put(_STOP)
            self._finished.wait(timeout)

    def _run(self) -> None:
        """Serve, then park. The thread never ends: ending runs MLX's thread-local
        destructors, whose compile cache holds Python functions and takes the GIL, and
        a process exiting meanwhile then aborts in C++ (``std::terminate``: seen as exit
        134 after a failed start). A parked daemon thread ends with the process."""
        try:
            self._serve()
        except BaseException:
            log.exception("the engine thread failed")
        finally:
            self._finish()
        threading.Event().wait()

    def _finish(self) -> None:
        """The work is over: refuse the requests read behind the stop or still queued,
        and (``submit``) those that come."""
        with self._closing:
            self._closed = True
        unread = self._unread
        while True:
            try:
                unread.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in unread:
            if cmd is not _STOP and cmd[0] == "add":
                _refuse(cmd[1], "the engine has stopped")
        self._finished.set()  # (``stop`` returns once every request has its last delta)

    def _serve(self) -> None:
        try:
            self.engine = engine = self._build()
        except BaseException as e:  # handed to start()
            self.build_error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            commands = [self._commands.get()] if not engine.has_work else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for i, cmd in enumerate(commands):
                if cmd is _STOP:
                    engine.close()
                    self._unread = commands[i + 1:]  # (``_finish`` refuses them)
                    return
                kind, arg = cmd
                if kind == "add":
                    try:
                        engine.add(arg)
                    except Exception as e:
                        _refuse(arg, str(e))
                else:
                    engine.abort(arg)
            if not engine.has_work:
                continue
            try:
                engine.step()
            except Exception:
                self.errors += 1
                message = traceback.format_exc()
                log.error("engine step failed; ending every request in flight:\n%s", message)
                engine.fail_all(message.strip().splitlines()[-1])


def _refuse(req: GenerationRequest, message: str) -> None:
    """End ``req`` before it ran: its one ``Delta``, finish reason "error"."""
    try:
        req.sink(Delta(req.rid, "", (), "error", None, message))
    except Exception:  # noqa: BLE001 - a sink that raises ends only its own request
        log.exception("the sink of request %r raised", req.rid)
