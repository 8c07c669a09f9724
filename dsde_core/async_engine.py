"""Streaming: the engine's step loop in a background thread, each request an async iterator of outputs.

    engine = AsyncEngine(llm.engine).start()
    async for out in engine.generate(prompt_ids, SamplingParams(max_tokens=64)):
        print(out.text, end="")

Leaving the iterator early (a client that hangs up) cancels the request; the engine frees its slot and
all of its state at the start of the next step.

Admission: requests join the running batch at the next step boundary. When the engine is idle, the first arrival
waits `admit_wait_s` (like `@serve.batch`'s batch_wait_timeout_s) so that a burst of requests starts as one batch:
one prefill instead of one per straggler, and the same batch, hence the same numerics, as in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import traceback
from collections.abc import AsyncIterator, Sequence

from dsde_core.config import SamplingParams, SpeculationParams
from dsde_core.engine import Engine
from dsde_core.request import Request, RequestOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05, admit_wait_s: float = 0.0) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.admit_wait_s = admit_wait_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsde-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The step loop's thread is running (a server's health check)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                if self.admit_wait_s > 0 and self.engine.has_unfinished():
                    self._stopping.wait(self.admit_wait_s)  # let the rest of a burst arrive: one batch, one prefill
                    continue
                if not self.engine.recovering:
                    continue  # idle; with a worker down, an idle step still probes it (and sends deferred releases)
            try:
                self.engine.step()
            except Exception as e:  # a failed step ends the requests in it with an error, never a hang; the
                self.last_error = traceback.format_exc()  # waiting ones run next
                log.error("engine step failed; its requests end with an error", exc_info=e)
                self.engine.fail_running(f"engine step failed: {type(e).__name__}: {e}")

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        spec: SpeculationParams | None = None,
        req_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs as they are accepted; the last one has finished=True."""
        outputs = self.submit(prompt_ids, params, spec, req_id)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        spec: SpeculationParams | None = None,
        req_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Like generate, but the request joins the engine's queue now, before the first output is awaited (a
        server counts it against its queue bound at once). Whoever never iterates the result must cancel(req_id)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        req = self.engine.add_request(prompt_ids, params, spec, req_id,
                                      on_output=lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        self._wake.set()
        return self._outputs(req, queue)

    def cancel(self, req_id: str) -> None:
        """Cancel a request (a no-op for one that has finished); it is freed at the start of the next step."""
        if self.engine.cancel(req_id):
            self._wake.set()

    async def _outputs(self, req: Request, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self.cancel(req.req_id)
