"""The one compute loop: loads the engine, admits and aborts jobs, steps, and emits replies.

It runs on its own thread, the engine's only owner: no other thread calls the LLMEngine or reads its
state. Other threads read the immutable EngineView it publishes once the engine is warm (the
tokenizer's encode, the model's facts) and the `snapshot` of figures it replaces whole after each
iteration; energy settles on the sampler's thread (on_finish only takes what is settled, never
waiting for it). The I/O thread hands it commands over a queue (the loop blocks on that queue
while idle, waking at least every `idle_wake_s` so a watchdog hook keeps ticking). Replies collect in `outbox` and are handed to
`deliver()` once per iteration; the server sends them from this thread under its socket lock.
Waking the I/O thread for every token instead cost 0.5-0.8 ms per token on a 2-core machine:
each wake-up and each GIL hand-off between the two threads waits for the scheduler.
Hooks let the daemon add the systemd watchdog (`on_loop`) and energy accounting (`on_step`,
`on_finish`) without this file knowing either.

A step's failure ends only the requests it names (the engine reports them with finish reason
"error"); EngineFailed (a lost device, out of memory that does not recover) fails every job and sets
`failed`, and so do MAX_STEP_FAILURES steps in a row failing outside the model run (a bug).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from o3edge.engine.sequence import Priority, SamplingParams
from o3edge.errors import EngineFailed, O3Error
from o3edge.ipc import protocol as P
from o3edge.ipc.engine_view import EngineView, view_of

if TYPE_CHECKING:  # the engine (and torch) is imported by the loader, on the engine thread
    from o3edge.engine.engine import LLMEngine, RequestOutput, StepReport

log = logging.getLogger(__name__)

TOKEN, END = b"T", b"E"  # outbox entry kind: more replies follow for this job / this is its last reply
MAX_STEP_FAILURES = 3  # consecutive steps failing outside the model run before the engine is declared dead
RATE_WINDOW_S = 10.0


@dataclass
class Hooks:
    """Callbacks run on the engine thread; an exception in one is logged, never fatal.

    on_loop(): every loop iteration, at least every idle_wake_s (send WATCHDOG=1 from here).
    on_admit(request_id, priority): when a job reaches the engine loop, before the engine sees it
        (so figures per priority class can name the class of every request, even one refused).
    on_step(report): after every engine step (energy accounting).
    on_finish(request_id, outcome) -> energy map or None: when a job ends; outcome is the
        finish reason ("stop", "length") or the error code. The map goes into `done.energy`.
    stats() -> map: extra fields for the `stats` reply (energy totals); runs on the I/O thread.
    on_phase(name): before "loading" and "warming_up", and at "ready" (systemd EXTEND_TIMEOUT_USEC,
        STATUS); runs on the engine thread.
    """

    on_loop: Callable[[], None] | None = None
    on_admit: Callable[[str, str], None] | None = None
    on_step: Callable[["StepReport"], None] | None = None
    on_finish: Callable[[str, str], dict | None] | None = None
    stats: Callable[[], dict] | None = None
    on_phase: Callable[[str], None] | None = None


@dataclass
class Job:
    """One admitted generate request as the engine loop tracks it."""

    rid: str  # engine request id, unique in this daemon
    identity: bytes  # the client's ZeroMQ routing id
    request: P.GenerateRequest
    prompt_ids: list[int]
    received: float  # time.monotonic() when the I/O thread read it
    deadline: float | None = None
    index: int = 0  # completion tokens sent so far
    started: float | None = None  # start of its first engine step
    first_token: float | None = None
    text: list[str] = field(default_factory=list)  # kept only when not streaming
    token_ids: list[int] = field(default_factory=list)


class EngineLoop:
    """Owns the LLMEngine on one thread; talk to it with submit(), abort() and stop()."""

    def __init__(self, load: Callable[[], "LLMEngine"], deliver: Callable[[], None], hooks: Hooks,
                 idle_wake_s: float = 1.0):
        self._load, self._deliver = load, deliver
        self.hooks = hooks
        self.idle_wake_s = idle_wake_s
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.state = "loading"  # -> ready -> stopped, or failed
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._engine: "LLMEngine | None" = None  # this thread's alone; other threads read `view`
        self.view: EngineView | None = None  # published once the engine is warm (immutable)
        self.snapshot: dict = {}  # engine figures for `stats`, replaced whole after each iteration
        self.counts = {"finished": 0, "failed": 0, "aborted": 0}
        self._jobs: dict[str, Job] = {}
        self._rate: deque[tuple[float, int]] = deque()  # (step end, tokens) over the last RATE_WINDOW_S
        self._rate_sum = 0
        self.outbox: deque[tuple[bytes, bytes, str, bytes]] = deque()  # (kind, identity, rid, reply)
        self.divert: Callable[[Job], bool] | None = None  # takes a job refused as busy elsewhere (upstream)
        self._failures = 0

    # ---- called from other threads ---------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.commands.put(("add", job))

    def abort(self, rid: str, code: str | None = None, message: str = "") -> None:
        """Abort a job; with a code its client gets that error as the job's last reply."""
        self.commands.put(("abort", rid, code, message))

    def stop(self, reason: str = "the daemon stopped before this request finished") -> None:
        """End the loop; jobs still running get `unavailable` with `reason`."""
        self.commands.put(("stop", reason))

    def call(self, fn: Callable[["LLMEngine"], None]) -> None:
        """Run fn(engine) on the engine thread between steps (applying reloaded limits, for example)."""
        self.commands.put(("call", fn))

    # ---- the thread ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self._start():
                self._serve()
        finally:
            self._flush()
            self._close_engine()
            self.ready.set()  # wake waiters even on failure

    def _start(self) -> bool:
        try:
            self._hook("on_phase", "loading")
            self._engine = self._load()
            self._hook("on_phase", "warming_up")
            self._warm_up()
            self.view = view_of(self._engine)
        except BaseException as exc:  # a broken model must end the daemon with a clear log line
            log.error("engine failed to load: %s", exc, exc_info=not isinstance(exc, O3Error))
            self.error, self.state = exc, "failed"
            return False
        self._publish()
        self.state = "ready"
        self.ready.set()
        self._hook("on_phase", "ready")
        return True

    def _close_engine(self) -> None:
        """Let the engine finish its background copies (the KV cold tier's) before the process ends."""
        close = getattr(self._engine, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("closing the engine failed")

    def _warm_up(self) -> None:
        """One short generation so first-request costs (allocations, kernels) are paid before ready."""
        engine = self._engine
        engine.add_request("warm-up", engine.encode("Hello, world.")[:8] or [0],
                           SamplingParams(max_new_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    def _serve(self) -> None:
        while self.state == "ready":
            self._hook("on_loop")
            busy = self._engine.has_unfinished_requests()
            self._take_commands(block=not busy)
            if self.state != "ready":
                break
            if self._engine.has_unfinished_requests():
                self._step()
            self._publish()  # before the replies go out: a client that reads `done` then asks for
            self._flush()    # stats sees the blocks of that request freed

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=self.idle_wake_s) if block else self.commands.get_nowait()
            while True:
                self._command(cmd)
                cmd = self.commands.get_nowait()
        except queue.Empty:
            pass

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            self._add(cmd[1])
        elif cmd[0] == "abort":
            self._abort(*cmd[1:])
        elif cmd[0] == "call":
            try:
                cmd[1](self._engine)
            except Exception:
                log.exception("engine call failed")
        elif cmd[0] == "stop":
            for rid in list(self._jobs):
                self._abort(rid, P.UNAVAILABLE, cmd[1])
            self.state = "stopped"

    def _add(self, job: Job) -> None:
        r = job.request
        self._hook("on_admit", job.rid, r.priority)
        try:
            params = SamplingParams(max_new_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                    top_k=r.top_k, seed=r.seed, stop=r.stop, ignore_eos=r.ignore_eos)
            self._engine.add_request(job.rid, job.prompt_ids, params, Priority[r.priority.upper()], job.deadline)
        except O3Error as exc:
            self._end(job, P.error(r.id, exc.code, exc.message), exc.code)
            return
        except Exception as exc:
            log.exception("add_request failed for %s", job.rid)
            self._end(job, P.error(r.id, P.INTERNAL, f"internal error: {type(exc).__name__}"), P.INTERNAL)
            return
        self._jobs[job.rid] = job

    def _abort(self, rid: str, code: str | None, message: str) -> None:
        job = self._jobs.pop(rid, None)
        self._engine.abort(rid)
        if job is None:
            return
        self.counts["aborted"] += 1
        self._hook("on_finish", rid, code or "dropped")
        if code is not None:  # else its client is gone: nobody to tell
            self._send(END, job, P.error(job.request.id, code, message))

    # ---- stepping ---------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs, report = self._engine.step()
        except EngineFailed as exc:  # the device is lost: nothing more can run
            log.error("%s; failing %d requests", exc, len(self._jobs), exc_info=exc.__cause__)
            for rid in list(self._jobs):
                self._abort(rid, P.UNAVAILABLE, "the engine failed (its device) while running this request")
            self.error, self.state = exc, "failed"
            return
        except Exception:  # a bug outside the model run and the requests' own work: the engine's books may be off
            self._step_failed()
            return
        self._failures = 0
        if report is not None:
            self._started(report)
            self._hook("on_step", report)
        elif not outputs:  # nothing could be scheduled this time; don't spin
            time.sleep(0.001)
        now = time.monotonic()
        self._count_rate(now, sum(len(out.token_ids) for out in outputs))
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is not None:
                self._emit(job, out, now)

    def _started(self, report: "StepReport") -> None:
        start = report.t_start_ns / 1e9
        for rid in report.tokens:
            job = self._jobs.get(rid)
            if job is not None and job.started is None:
                job.started = start

    def _step_failed(self) -> None:
        self._failures += 1
        log.exception("engine step failed (%d in a row); aborting %d requests", self._failures, len(self._jobs))
        for rid in list(self._jobs):
            self._abort(rid, P.INTERNAL, "the engine failed while running this request")
        if self._failures >= MAX_STEP_FAILURES:
            self.error, self.state = RuntimeError("the engine step keeps failing"), "failed"

    def _emit(self, job: Job, out: "RequestOutput", now: float) -> None:
        r = job.request
        if out.finish_reason == "deadline_exceeded":  # the scheduler cut it (queued or running)
            return self._expired(job, out)
        if out.finish_reason == "error":  # this request failed in the step; the others go on
            del self._jobs[job.rid]
            return self._end(job, P.error(r.id, P.INTERNAL, "the engine failed while running this request"),
                             P.INTERNAL)
        if out.finish_reason == P.BUSY:  # displaced from a full queue, never ran
            del self._jobs[job.rid]
            return self._end(job, P.error(r.id, P.BUSY, "the queue is full: a more important request took "
                                                        "this one's place"), P.BUSY)
        if job.first_token is None:
            job.first_token = now
        if r.stream:
            self._send(TOKEN, job, P.token(r.id, job.index, out.text, out.token_ids))
        else:
            job.text.append(out.text)
            job.token_ids.extend(out.token_ids)
        job.index += len(out.token_ids)
        if out.finished:
            del self._jobs[job.rid]
            self.counts["finished"] += 1
            energy = self._hook("on_finish", job.rid, out.finish_reason)
            extra = {} if r.stream else {"text": "".join(job.text), "token_ids": job.token_ids}
            self._send(END, job, P.done(r.id, out.finish_reason, _usage(out), _timings(job, out, now),
                                        energy, served_by="local", **extra))

    def _expired(self, job: Job, out: "RequestOutput") -> None:
        del self._jobs[job.rid]
        if out.text and job.request.stream:  # text the detokenizer held back until the end
            self._send(TOKEN, job, P.token(job.request.id, job.index, out.text, []))
        message = (f"deadline of {job.request.deadline_ms} ms passed "
                   + (f"after {job.index} completion tokens" if job.index else "before the request ran"))
        self._end(job, P.error(job.request.id, P.DEADLINE_EXCEEDED, message), P.DEADLINE_EXCEEDED)

    def _end(self, job: Job, message: dict, code: str) -> None:
        """Send a job's error reply (its last) and tell the hooks it ended; a `busy` job that never
        sent a token may be served elsewhere instead (divert)."""
        if code == P.BUSY and job.index == 0 and self.divert is not None and self.divert(job):
            self._hook("on_finish", job.rid, "forwarded")
            return
        self.counts["failed"] += 1
        self._hook("on_finish", job.rid, code)
        self._send(END, job, message)

    def _send(self, kind: bytes, job: Job, message: dict) -> None:
        self.outbox.append((kind, job.identity, job.rid, P.pack(message)))

    def _flush(self) -> None:
        if self.outbox:
            try:
                self._deliver()
            except Exception:
                log.exception("delivering replies failed")

    # ---- figures ----------------------------------------------------------------------------
    def _count_rate(self, now: float, num_tokens: int) -> None:
        if num_tokens:
            self._rate.append((now, num_tokens))
            self._rate_sum += num_tokens

    def _publish(self) -> None:
        now = time.monotonic()
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate_sum -= self._rate.popleft()[1]
        rate = self._rate_sum / max(now - self._rate[0][0], 1.0) if self._rate else 0.0
        self.snapshot = {**self._engine.stats(), "tokens_per_s": round(rate, 2), "jobs": len(self._jobs),
                         **self.counts}

    def _hook(self, name: str, *args):
        fn = getattr(self.hooks, name)
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception:
            log.exception("hook %s failed", name)
            return None


def _usage(out: "RequestOutput") -> dict:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "cached_tokens": out.num_cached_tokens, "cold_tokens": out.num_cold_tokens}


def _timings(job: Job, out: "RequestOutput", now: float) -> dict:
    ms = lambda t: round((t - job.received) * 1000, 3)  # noqa: E731
    ttft, total = job.first_token - job.received, now - job.received
    decode_s, n = total - ttft, out.num_output_tokens
    return {"queue_ms": ms(job.started if job.started is not None else now), "ttft_ms": ms(job.first_token),
            "total_ms": ms(now), "tokens_per_s": round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else 0.0}
