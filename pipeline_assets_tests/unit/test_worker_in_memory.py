"""The whole worker (its claim threads, heartbeat, rescue and stop) on the
in-memory queue and the fake OpenAI server: no database. Real time runs; the
backoff is short so that faults are waited out quickly.
"""

from __future__ import annotations

import hashlib

import pytest

from pipeline_assets.jobqueue.memory_job_store import MemoryJobStore
from pipeline_assets.jobqueue.memory_queue import MemoryQueue
from pipeline_assets.jobqueue.report import ReportCounts
from pipeline_assets.jobqueue.worker import FatalProviderError, Worker
from pipeline_assets.settings import Settings

CHUNKS = 40
BATCH = 8
BACKOFF = {"PIPELINE_BACKOFF_BASE": "0.01", "PIPELINE_BACKOFF_CAP": "0.05"}
CONFIG = Settings.from_env(BACKOFF).worker_config(
    concurrency=2, until_idle=True, poll_seconds=0.02, build_index=False, batch_inputs=BATCH
)


def checksum(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@pytest.fixture
def provider(fake):
    p = fake.provider()
    yield p
    p.close()


def worker_on(queue: MemoryQueue, provider, texts: list[str]) -> tuple[Worker, list[int]]:
    queue.add_content(1, [(checksum(t), t, len(t.split())) for t in texts])
    store = MemoryJobStore(
        queue,
        model_id=provider.spec.model_id,
        backoff_base=CONFIG.executor.backoff_base,
        backoff_cap=CONFIG.executor.backoff_cap,
    )
    worker = Worker("", provider, CONFIG, store=store)
    store.observers.append(ReportCounts(worker.report))  # the report counts what was applied
    queue.add_model(provider.spec.model_id)
    return worker, queue.enqueue([checksum(t) for t in texts], max_attempts=5)


def test_a_worker_drains_the_queue_and_bills_each_input_once(fake, provider):
    queue = MemoryQueue()
    texts = [f"chunk number {i}" for i in range(CHUNKS)]
    worker, jobs = worker_on(queue, provider, texts)
    report = worker.run()
    assert {queue.jobs[j].status for j in jobs} == {"ready"}
    assert report.embedded == CHUNKS and fake.stats["billed_inputs"] == CHUNKS
    assert all(fake.billed_count(t) == 1 for t in texts)


def test_a_worker_rides_out_provider_faults(fake, provider):
    queue = MemoryQueue()
    texts = [f"faulty chunk {i}" for i in range(CHUNKS)]
    worker, jobs = worker_on(queue, provider, texts)
    fake.fail_next(3, 500)
    worker.run()
    assert fake.stats["responses_by_status"][500] == 3
    assert {queue.jobs[j].status for j in jobs} == {"ready"}
    assert all(queue.jobs[j].attempts == 1 for j in jobs)  # a transient fault costs no attempt
    assert all(fake.billed_count(t) == 1 for t in texts)  # a 500 is not billed


def test_a_fatal_error_stops_the_worker_and_leaves_the_queue_untouched(fake, provider):
    queue = MemoryQueue()
    worker, jobs = worker_on(queue, provider, ["a", "b"])
    fake.fail_next(1, 401)
    with pytest.raises(FatalProviderError):
        worker.run()
    assert [(queue.jobs[j].status, queue.jobs[j].attempts) for j in jobs] == [("pending", 0), ("pending", 0)]
