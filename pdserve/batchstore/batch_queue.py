"""The Batch API's job queue: rq, in the Redis pdserve already uses, so ``rq info`` and rq-dashboard
show it. Two kinds of job, named by their import path (the batch worker defines them; nothing here
imports it): one validates a batch's input file and plans its chunks, one runs a chunk of lines.

rq's client is synchronous; the async callers run these methods in a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import logging

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from pdserve.scheduler.keys import Keys

logger = logging.getLogger(__name__)

VALIDATE_JOB = "pdserve.batch.jobs.validate_batch"
CHUNK_JOB = "pdserve.batch.jobs.run_chunk"
JOB_TIMEOUT_S = -1
"""No rq timeout: a chunk waits for spare capacity as long as its batch's window allows, and the
batch worker's own leases (not rq's job heartbeats) say whether a running chunk's worker is alive."""
RESULT_TTL_S = 3600


def chunk_job_id(batch_id: str, chunk: int, attempt: int) -> str:
    return f"{batch_id}-{chunk}-{attempt}"  # rq refuses any id character but [A-Za-z0-9_-]


def job_attempt(job_id: str) -> int:
    """The attempt number in a :func:`chunk_job_id` (0 for anything else)."""
    tail = job_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class BatchQueue:
    """Enqueue batch jobs and look at their state."""

    def __init__(self, connection: redis.Redis, keys: Keys) -> None:
        self.connection = connection
        self.queue = Queue(keys.batch_queue, connection=connection)

    def enqueue_validate(self, batch_id: str, attempt: int = 0) -> str:
        job = self.queue.enqueue(
            VALIDATE_JOB,
            batch_id,
            job_id=f"{batch_id}-validate" + (f"-{attempt}" if attempt else ""),
            job_timeout=JOB_TIMEOUT_S,
            result_ttl=RESULT_TTL_S,
            failure_ttl=RESULT_TTL_S,
            description=f"validate batch {batch_id}",
        )
        return job.id

    def enqueue_chunk(self, batch_id: str, chunk: int, attempt: int = 0) -> str:
        job = self.queue.enqueue(
            CHUNK_JOB,
            batch_id,
            chunk,
            job_id=chunk_job_id(batch_id, chunk, attempt),
            job_timeout=JOB_TIMEOUT_S,
            result_ttl=RESULT_TTL_S,
            failure_ttl=RESULT_TTL_S,
            description=f"batch {batch_id} chunk {chunk}",
        )
        return job.id

    def status(self, job_id: str) -> str | None:
        """rq's status of a job (``queued``, ``started``, ``finished``, ``failed``…), None if gone."""
        try:
            return Job.fetch(job_id, connection=self.connection).get_status(refresh=False)
        except NoSuchJobError:
            return None

    def waiting(self, job_id: str) -> bool:
        """The job is in the queue's list, not yet taken by a worker."""
        return job_id in self.queue.get_job_ids()

    def waiting_ids(self) -> set[str]:
        """The ids of every job in the queue's list (one ``LRANGE``): the reaper reads it once per
        pass, not once per chunk."""
        return set(self.queue.get_job_ids())

    def cancel(self, job_id: str) -> None:
        """Take a queued job out of the queue (a started one ends itself when it sees its batch's status)."""
        try:
            job = Job.fetch(job_id, connection=self.connection)
        except NoSuchJobError:
            return
        if job.get_status(refresh=False) in (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED):
            job.cancel()

    def depth(self) -> int:
        """Jobs waiting in the queue."""
        return self.queue.count
