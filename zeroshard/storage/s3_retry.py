"""S3 requests whose retries are bounded in time (`zeroshard_retry_s`, issue 17).

Left to themselves, s3fs retries a request 5 times and botocore each of those up to 5 times,
with timeouts of 5 s (connect) and 15 s (read) per attempt: with the network gone mid-upload a
command took about four minutes to fail. Here botocore and s3fs each make one attempt, and
BoundedS3FileSystem retries every request itself (backoff 0.1 s doubling to 2 s) until it
succeeds, fails in a way a retry cannot fix (a 4xx), or has kept failing for `retry_s` seconds:
then it gives up with _BudgetSpent. Once it has been failing, an attempt is also cut off
when the budget runs out, so a hung connection cannot stretch it; before that, a hung request is
ended by botocore's timeouts (connect, read: no longer than the budget) or, while it sends a
body, after `retry_s` plus the body's size at SLOWEST_UPLOAD_BPS.

After a request gave up, S3 is presumed unreachable: later requests (the clean-up of a failed
write: aborting its upload, releasing its claim) get a single attempt each, so a failing command
ends about `retry_s` after the trouble began instead of spending a budget per clean-up step.
The first request that succeeds ends that state.
"""

from __future__ import annotations

import asyncio
import errno
import random
from typing import Any, Awaitable, Callable, TypeVar

from fsspec.asyn import sync_wrapper
from s3fs import S3FileSystem

T = TypeVar("T")
CONNECT_TIMEOUT_S = 5.0  # s3fs's defaults, lowered to the budget when it is smaller
READ_TIMEOUT_S = 15.0
SLOWEST_UPLOAD_BPS = 1024 * 1024  # a request body sent slower than this (after retry_s of grace) has stalled
# the retry jitter's own generator: a retry must not move the training's global `random` stream,
# which checkpoints save and resumes restore
_JITTER = random.Random()
_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout",
                "InternalError", "ServiceUnavailable", "XAmzContentSHA256Mismatch"}


class _BudgetSpent(OSError):
    """A request kept failing for the whole retry budget (an OSError: storage_errors turns it
    into a StorageError naming the URL)."""

    def __init__(self, spent_s: float, budget_s: float, last: BaseException, at_once: bool = False):
        self.last = last
        said = (f"not retried: S3 has not answered since an earlier request gave up (zeroshard_retry_s={budget_s:g})"
                if at_once else f"gave up after {spent_s:.1f} s (zeroshard_retry_s={budget_s:g})")
        super().__init__(errno.ETIMEDOUT, f"{said}: {_short(last)}")

    def __str__(self) -> str:
        return self.strerror


def _short(exc: BaseException) -> str:
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    if ": \"http" in text:  # botocore's connection errors end with the whole request URL: noise here
        text = text.split(": \"http", 1)[0]
    return text[:160]


def retryable(exc: BaseException) -> bool:
    """Whether a retry may help: connection trouble, timeouts, 5xx and throttling answers."""
    if isinstance(exc, _BudgetSpent):
        return False
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return True
    from botocore.exceptions import ClientError

    cause = exc.__cause__ if isinstance(exc.__cause__, ClientError) else exc
    if isinstance(cause, ClientError):  # s3fs turns these into OSErrors; the answer is in the cause
        meta = cause.response.get("ResponseMetadata", {})
        code = cause.response.get("Error", {}).get("Code", "")
        return int(meta.get("HTTPStatusCode") or 0) >= 500 or code in _RETRY_CODES
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, IncompleteReadError

    # connection closed or refused, endpoint unreachable, timeouts, a body cut short
    if isinstance(exc, (HTTPClientError, BotoConnectionError, IncompleteReadError)):
        return True
    try:
        import aiohttp

        return isinstance(exc, aiohttp.ClientError)
    except ImportError:
        return False


def client_config(retry_s: float, given: dict[str, Any] | None) -> dict[str, Any]:
    """botocore Config options: one attempt per request (the retries are ours), timeouts no longer
    than the budget. Options the user gave win."""
    config = dict(given or {})
    config.setdefault("connect_timeout", min(CONNECT_TIMEOUT_S, retry_s))
    config.setdefault("read_timeout", min(READ_TIMEOUT_S, max(retry_s, 1.0)))
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    return config


class BoundedS3FileSystem(S3FileSystem):
    """s3fs's filesystem, its requests retried within `retry_s` seconds (see the module doc)."""

    retries = 1  # s3fs's own retry loop: off (ours is below)

    def __init__(self, *args: Any, retry_s: float = 60.0, **kwargs: Any):
        kwargs["config_kwargs"] = client_config(retry_s, kwargs.get("config_kwargs"))
        super().__init__(*args, **kwargs)
        self.retry_s = retry_s
        self.unreachable = False  # a request gave up, and none has succeeded since

    async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
        body = kwargs.get("Body")
        # sending has no timeout of its own (botocore's read timeout starts once the body is sent):
        # an upload stalled mid-body counts as failed once it is slower than SLOWEST_UPLOAD_BPS
        cap = self.retry_s + len(body) / SLOWEST_UPLOAD_BPS if isinstance(body, (bytes, bytearray)) else None
        return await self.within_budget(lambda: super(BoundedS3FileSystem, self)._call_s3(method, *akwarglist,
                                                                                           **kwargs), cap)

    async def _cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        # the body is read after _call_s3 returned: a connection dropped mid-body is retried here
        return await self.within_budget(lambda: super(BoundedS3FileSystem, self)._cat_file(path, *args, **kwargs))

    # s3fs binds its blocking call_s3 to S3FileSystem._call_s3 in its class body, so an override
    # of _call_s3 alone is bypassed by every blocking call_s3: the leftovers scan's upload listing
    # (run by every command before it writes into an output) and S3File's writes (put_object,
    # multipart) went out with no retry, and one 503 SlowDown failed the command (issue 51).
    call_s3 = sync_wrapper(_call_s3)

    async def within_budget(self, attempt: Callable[[], Awaitable[T]], cap: float | None = None) -> T:
        """Run `attempt()` until it succeeds, fails for good, or the budget is spent. `cap`: the
        longest the first attempt may take (the later ones are cut off by the budget)."""
        loop = asyncio.get_running_loop()
        first_failure: float | None = None
        cause: Exception | None = None
        delay = 0.1
        while True:
            left = None if first_failure is None else first_failure + self.retry_s - loop.time()
            try:
                if left is None:
                    result = await (attempt() if cap is None else asyncio.wait_for(attempt(), cap))
                else:  # failing already: this attempt may not outlast the budget
                    result = await asyncio.wait_for(attempt(), max(left, 0.001))
            except Exception as exc:  # noqa: BLE001 - sorted below: retried, or raised as it is
                if not retryable(exc):
                    raise
                if not isinstance(exc, asyncio.TimeoutError) or cause is None:
                    cause = exc  # what went wrong, rather than our cutting the last attempt short
                now = loop.time()
                if first_failure is None:
                    first_failure = now
                    if self.unreachable:  # an earlier request spent the budget: clean-up gets one try
                        raise _BudgetSpent(0.0, self.retry_s, cause, at_once=True) from exc
                left = first_failure + self.retry_s - now
                if left <= 0:
                    self.unreachable = True
                    raise _BudgetSpent(now - first_failure, self.retry_s, cause) from exc
                # jitter: the parts of an upload do not all retry in step
                await asyncio.sleep(min(delay * (0.5 + _JITTER.random()), left))
                delay = min(delay * 2, 2.0)
            else:
                self.unreachable = False
                return result
