"""Batch API jobs in a replay: each job is a batch submitted at a second of the trace with its requests' shape and
completion window, run by the gateway's batch runner as it runs in the fleet (gateway/batch/capacity.py: only while
no interactive request waits in the gateway queue, only to pods that are not saturated, up to each pod's free batch
slots less the interactive reserve and never more than the batch share, at the lowest engine priority so an
interactive arrival preempts a batch request). Jobs take turns, one request each, as tenants' batches do. A job
whose window ends before its last request is answered ends expired: its requests not yet sent are never sent.

What a policy sees of them is what the gateways report to the operator (operator/batch_demand.py): each unfinished
job's remaining requests, their mean prompt and output tokens, and its deadline.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.autoscale_replay.engine_model import MEAN_OUTPUT_TOKENS, EngineModel, Pod, Request
from kvfleet.autoscale_replay.trace import MAX_TIME_S, TraceError, csv_rows, parse_time, parse_tokens
from kvfleet.gateway.batch.capacity import BatchRoom
from kvfleet.gateway.routing.pick import EndpointSnapshot
from kvfleet.operator.autoscaler import PodLoad
from kvfleet.operator.batch_demand import BatchBacklog

JOB_COLUMNS = ("t", "requests", "prompt_tokens", "output_tokens", "window_s")
MAX_JOBS = 1_000
MAX_JOB_REQUESTS = 1_000_000  # the runs a replay can afford; a Batch API file holds at most 50,000 (OpenAI's)
MAX_WINDOW_S = 168 * 3600  # the Batch API's longest completion window
BATCH_RID = 1 << 40  # batch requests' ids start here, apart from the trace's rows
ROOM = BatchRoom()  # the gateway runner's defaults


@dataclass(frozen=True, slots=True)
class BatchJob:
    t: float  # seconds from the trace's start: when the batch is created
    requests: int
    prompt_tokens: int  # per request
    output_tokens: int  # per request
    window_s: float  # completion window: the batch expires at t + window_s

    @property
    def deadline(self) -> float:
        return self.t + self.window_s


def read_jobs_csv(path: Path) -> tuple[BatchJob, ...]:
    """The jobs in a CSV file with a header naming at least JOB_COLUMNS; a TraceError names a bad line."""
    try:
        raw = path.open("rb")
    except OSError as err:
        raise TraceError(f"{path}: cannot read it ({err.strerror or err}); give the path of a CSV file of "
                               f"batch jobs ({','.join(JOB_COLUMNS)})") from None
    with raw:
        return parse_jobs(csv_rows(raw, str(path), JOB_COLUMNS), str(path))


def parse_jobs(rows: Iterable[tuple[int, list[str]]], name: str) -> tuple[BatchJob, ...]:
    """Jobs from (line, cells in JOB_COLUMNS order) rows."""
    jobs = []
    for line, (t, requests, prompt, output, window) in rows:
        if len(jobs) >= MAX_JOBS:
            raise TraceError(f"{name} line {line}: more than {MAX_JOBS:,} batch jobs; replay fewer")
        count = parse_tokens(requests, "requests", name, line, MAX_JOB_REQUESTS)
        seconds = parse_time(window, name, line, "window_s", MAX_WINDOW_S)
        if seconds < 60:
            raise TraceError(f"{name} line {line}: window_s is {window[:40]!r}; a completion window is at least "
                             "60 seconds (the Batch API's 1m)")
        start = parse_time(t, name, line)
        if start + seconds > MAX_TIME_S:  # the replay runs to the last deadline, a second at a time
            raise TraceError(f"{name} line {line}: the job's window ends {start + seconds:,.0f} s from the start, past "
                             f"the {MAX_TIME_S:,} s (a week) a replay covers; start it earlier or shorten window_s")
        jobs.append(BatchJob(start, count, parse_tokens(prompt, "prompt_tokens", name, line),
                             parse_tokens(output, "output_tokens", name, line), seconds))
    if not jobs:
        raise TraceError(f"{name}: no batch jobs after the header; add one row per job ({','.join(JOB_COLUMNS)})")
    return tuple(sorted(jobs, key=lambda j: j.t))


def write_jobs_csv(jobs: Iterable[BatchJob], path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        out.write(",".join(JOB_COLUMNS) + "\n")
        out.writelines(f"{j.t!r},{j.requests},{j.prompt_tokens},{j.output_tokens},{j.window_s!r}\n" for j in jobs)


@dataclass
class _Progress:
    job: BatchJob
    sent: int = 0
    answered: int = 0
    answered_on_time: int = 0
    expired: int = 0  # never sent: the window ended first
    finished_at: float | None = None  # when its last request was answered (or the window ended)
    in_flight: list[Request] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.job.requests - self.answered - self.expired

    @property
    def unsent(self) -> int:
        return self.job.requests - self.sent - self.expired


class BatchRunner:
    """The gateways' batch runner as the simulated fleet drives it, once a second after routing interactive work."""

    def __init__(self, jobs: Iterable[BatchJob], engine: EngineModel, room: BatchRoom = ROOM) -> None:
        self.engine, self.room = engine, room
        self.jobs = [_Progress(j) for j in sorted(jobs, key=lambda j: j.t)]
        self._by_pod: dict[int, list[Request]] = {}  # id(pod) -> its batch requests not yet answered
        self._owner: dict[int, _Progress] = {}  # request id -> its job
        self._turn = 0
        self._next_rid = BATCH_RID
        self.output_tokens = 0  # answered batch requests' output tokens

    def settle(self, now: float) -> None:
        """Count the requests answered by now; end the jobs whose window has passed (their unsent requests expire)."""
        for pod_id, requests in list(self._by_pod.items()):
            still = []
            for r in requests:
                if r.done:
                    self._answered(self._owner.pop(r.rid), r, now)
                else:
                    still.append(r)
            self._by_pod[pod_id] = still
        for p in self.jobs:
            if p.finished_at is not None or p.job.t > now:
                continue
            if now >= p.job.deadline and p.unsent:
                p.expired += p.unsent
            if p.remaining == 0:  # every request answered or expired
                p.finished_at = now

    def _answered(self, p: _Progress, r: Request, now: float) -> None:
        p.in_flight.remove(r)
        p.answered += 1
        p.answered_on_time += now <= p.job.deadline
        self.output_tokens += r.output_tokens

    def backlog(self, now: float) -> tuple[BatchBacklog, ...]:
        """What the gateways report: each job created by now with requests not yet answered."""
        return tuple(BatchBacklog(p.remaining, float(p.job.prompt_tokens), float(p.job.output_tokens), p.job.deadline)
                     for p in self.jobs if p.job.t <= now and p.finished_at is None and p.remaining > 0)

    def dispatch(self, now: float, pods: list[tuple[Pod, PodLoad, int, bool]], interactive_queued: int
                 ) -> dict[int, list[Request]]:
        """Batch requests to send now: (pod, its scrape, requests sent to it this second, saturated) per ready pod;
        pod index -> requests. Nothing while interactive requests wait in the gateway queue."""
        active = [p for p in self.jobs if p.job.t <= now < p.job.deadline and p.unsent > 0]
        if interactive_queued > 0 or not active:
            return {}
        out: dict[int, list[Request]] = {}
        for k, (pod, load, sent, saturated) in enumerate(pods):
            if saturated or pod.draining:
                continue
            snapshot = EndpointSnapshot(str(k), True, load.kv_cache_usage or 0.0, load.waiting or 0,
                                        load.running or 0, 0.0, in_flight=sent, max_num_seqs=self.engine.max_num_seqs)
            held = self._by_pod.setdefault(id(pod), [])
            free = self.room.room(snapshot, len(held))
            while free > 0 and active:
                p = active[self._turn % len(active)]
                request = self._request(p, now)
                held.append(request)
                out.setdefault(k, []).append(request)
                free -= 1
                if p.unsent == 0:
                    active.remove(p)
                else:
                    self._turn += 1
        return out

    def _request(self, p: _Progress, now: float) -> Request:
        e = self.engine
        request = Request(self._next_rid, now, p.job.prompt_tokens / e.prefill_tokens_per_s,
                          p.job.output_tokens / MEAN_OUTPUT_TOKENS, prompt_tokens=p.job.prompt_tokens,
                          output_tokens=p.job.output_tokens, batch=True)
        self._next_rid += 1
        p.sent += 1
        p.in_flight.append(request)
        self._owner[request.rid] = p
        return request

    def unfinished(self, now: float) -> bool:
        """Whether a job created by now still has requests to answer within its window."""
        return any(p.finished_at is None and p.remaining > 0 and now < p.job.deadline for p in self.jobs)

    def report(self) -> dict:
        """Per job: when it was created, its deadline, when it finished (None: not by the end of the run), how many
        requests were answered by the deadline, answered late, and expired; and the totals."""
        jobs = [{"t": p.job.t, "requests": p.job.requests, "deadline_s": p.job.deadline,
                 "finished_s": p.finished_at, "on_time": p.answered_on_time == p.job.requests,
                 "answered_on_time": p.answered_on_time, "answered_late": p.answered - p.answered_on_time,
                 "expired": p.expired} for p in self.jobs]
        return {"jobs": jobs, "jobs_on_time": sum(j["on_time"] for j in jobs),
                "requests": sum(p.job.requests for p in self.jobs),
                "answered_on_time": sum(p.answered_on_time for p in self.jobs),
                "output_tokens": self.output_tokens}


def jobs_from_text(text: str, name: str = "jobs") -> tuple[BatchJob, ...]:
    """Jobs from CSV text (tests and workloads)."""
    return parse_jobs(csv_rows(io.BufferedReader(io.BytesIO(text.encode())), name, JOB_COLUMNS), name)
