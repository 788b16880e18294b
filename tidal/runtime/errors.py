"""Errors the runtime raises: each names the group, rank, method, channel or key involved."""

from __future__ import annotations


class PlacementError(ValueError):
    """A placement that cannot be realised on this cluster."""


class WorkerError(RuntimeError):
    """A method failed on a remote rank; the message carries the remote traceback."""

    def __init__(self, group: str, rank: int, method: str, error: str, remote_traceback: str = ""):
        self.group, self.rank, self.method = group, rank, method
        self.error, self.remote_traceback = error, remote_traceback
        message = f"{group}[rank {rank}].{method} failed: {error}"
        if remote_traceback:
            message += (
                f"\n--- remote traceback ({group} rank {rank}) ---\n{remote_traceback.rstrip()}"
            )
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.group, self.rank, self.method, self.error, self.remote_traceback)


class WorkerTimeoutError(TimeoutError):
    """Some ranks had not answered within the timeout."""

    def __init__(
        self, group: str, method: str, pending_ranks: list[int], timeout: float, where: str = ""
    ):
        """``where``: the stacks of the late ranks, where the backend can tell (ranks in this
        process)."""
        self.group, self.method, self.pending_ranks, self.timeout, self.where = (
            group,
            method,
            pending_ranks,
            timeout,
            where,
        )
        message = f"{group}.{method}: ranks {pending_ranks} had not answered after {timeout:g} s"
        super().__init__(
            f"{message}; where this process's ranks were:\n{where}" if where else message
        )

    def __reduce__(self):
        return type(self), (self.group, self.method, self.pending_ranks, self.timeout, self.where)


class ChannelTimeoutError(TimeoutError):
    """A channel operation waited longer than its timeout; nothing was taken or lost."""

    def __init__(self, channel: str, op: str, key, timeout: float):
        self.channel, self.op, self.key, self.timeout = channel, op, key, timeout
        super().__init__(f"channel {channel!r}: {op}(key={key!r}) timed out after {timeout:g} s")

    def __reduce__(self):
        return type(self), (self.channel, self.op, self.key, self.timeout)


class WeightSyncError(RuntimeError):
    """A weight link failed: set-up, a peer gone mid-transfer, a timeout, a server's reload.
    Names the link, the rank and the call. A restart (``runner.max_restarts``) cures it: the
    restarted run opens a new link."""


class WeightUpdateAborted(RuntimeError):
    """The sender of a weight update failed while reading its weights (e.g. a sharded gather)
    and aborted the update: its own error is the cause; no restart cures a bug."""


# The errors a restart (``runner.max_restarts``) can cure, by the name a rank reports them with
# (``CallResult.error`` starts with it): a rank whose process died, a supervised server gone, a
# weight link broken, a wait on a peer that never answered. A bug fails the same way again.
RESTARTABLE = (
    "rank died",
    "ServerDied",
    "WeightSyncError",
    "ChannelTimeoutError",
    "WorkerTimeoutError",
)


def is_restartable(exc: BaseException) -> bool:
    """A fault a restart can cure, raised here or reported by a rank (``WorkerError``)."""
    if isinstance(exc, WorkerError):
        return exc.error.startswith(RESTARTABLE)
    return isinstance(
        exc, WorkerTimeoutError | ChannelTimeoutError | WeightSyncError | ConnectionError
    )


class ClusterUnreachable(ConnectionError):
    """Nothing answers at the cluster address: a configuration error, named before anything runs."""
