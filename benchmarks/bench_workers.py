"""Workers for the benchmarks (importable by Ray worker processes)."""

from tidal.runtime import Worker


class PingWorker(Worker):
    def ping(self):
        return self.rank


class Sink(Worker):
    def take(self, channel, key="default"):
        return channel.get(key=key, timeout=60).shape[0]
