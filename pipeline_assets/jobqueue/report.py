"""What a worker run did, counted from what its store applied (an observer)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pipeline_assets.counts import Counts
from pipeline_assets.jobqueue.changes import Change, Complete, Fail, GiveBack, JobObserver, Retry, Supersede
from pipeline_assets.jobqueue.status import JobStatus


@dataclass
class WorkerReport(Counts):
    embedded: int = 0
    superseded: int = 0
    failed: int = 0
    retried: int = 0
    throttled: int = 0
    refused: int = 0
    provider_calls: int = 0
    tokens: int = 0
    rescued: int = 0
    fatal: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, value in counts.items():
                setattr(self, key, getattr(self, key) + value)


class ReportCounts(JobObserver):
    """Counts into a ``WorkerReport`` what each applied transition made of its jobs."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def applied(self, change: Change, became: dict[int, str]) -> None:
        statuses = list(became.values())
        if isinstance(change, Complete):
            self.report.add(embedded=statuses.count(JobStatus.READY))
        elif isinstance(change, Supersede):  # unwanted content, or held jobs a completion could not store
            self.report.add(superseded=len(statuses), refused=len(change.job_ids) - len(statuses))
        elif isinstance(change, Retry):
            self.report.add(retried=statuses.count(JobStatus.RETRY), failed=statuses.count(JobStatus.FAILED))
        elif isinstance(change, Fail):
            self.report.add(failed=len(statuses))
        elif isinstance(change, GiveBack):  # a job whose lease another worker holds now stays with it
            self.report.add(
                throttled=len(statuses) if change.throttled else 0, refused=len(change.job_ids) - len(statuses)
            )

    def rescued(self, count: int) -> None:
        self.report.add(rescued=count)
