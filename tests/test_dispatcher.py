"""Asynchronous rollout for language agents: the staleness manager and the dispatcher that
holds episodes to it."""

import asyncio
import threading
import time

import pytest
import torch

from tidal.asynchrony import StalenessManager
from tidal.data import LLMBatch
from tidal.rollout.dispatcher import EpisodeError, RolloutDispatcher

# ----------------------------------------------------------------------------- staleness


def test_capacity_formula_and_hooks():
    m = StalenessManager(max_staleness=2, consumer_batch_size=4, max_concurrent_rollouts=10)
    assert m.get_capacity() == min(10, (2 + 0 + 1) * 4)  # 10 vs 12
    for _ in range(10):
        m.on_rollout_enqueued()
        m.on_rollout_submitted()
    assert m.get_capacity() == 0  # concurrency bound
    for _ in range(6):
        m.on_rollout_accepted()
    for _ in range(2):
        m.on_rollout_rejected()
    assert m.snapshot() == {"enqueued": 0, "running": 2, "accepted": 6, "rejected": 2}
    assert m.get_capacity() == min(10 - 2, 12 - (6 + 2))  # staleness bound: 4
    m.set_version(1)
    assert m.get_capacity() == min(8, 16 - 8)
    for _ in range(2):
        m.on_rollout_accepted()
    m.set_version(0)
    assert m.get_capacity() == 12 - 8 - 0 == 4
    for _ in range(6):
        m.on_rollout_enqueued()
        m.on_rollout_submitted()
    assert m.get_capacity() == 12 - 14  # may be negative


def test_restore_after_resume_and_bad_arguments():
    m = StalenessManager(1, 8, 100)
    m.restore(5)
    assert m.snapshot()["accepted"] == 40 and m.get_version() == 5
    assert m.get_capacity() == (1 + 5 + 1) * 8 - 40
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(-1, 8, 8)


def test_counters_are_thread_safe():
    m = StalenessManager(0, 1, 10**6)

    def work():
        for _ in range(2000):
            m.on_rollout_enqueued()
            m.on_rollout_submitted()
            m.on_rollout_accepted()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.snapshot() == {"enqueued": 0, "running": 0, "accepted": 8000, "rejected": 0}


# ----------------------------------------------------------------------------- dispatcher


def test_dispatcher_respects_the_staleness_bound_and_keeps_the_stream():
    staleness = StalenessManager(
        max_staleness=1, consumer_batch_size=4, max_concurrent_rollouts=100
    )
    peak = {"admitted": 0}

    async def episode(x):
        s = staleness.snapshot()
        peak["admitted"] = max(peak["admitted"], s["accepted"] + s["running"])
        await asyncio.sleep(0.01)
        return {"x": x}

    d = RolloutDispatcher(episode, staleness)
    try:
        first = d.prepare_batch(range(1000), 4, timeout=30)
        assert [r["x"] for r in first] == [0, 1, 2, 3]  # oldest first
        assert peak["admitted"] <= (1 + 0 + 1) * 4
        staleness.set_version(1)
        d.wake()
        second = d.prepare_batch(range(1000), 4, timeout=30)
        assert [r["x"] for r in second] == [4, 5, 6, 7]  # the stream goes on, it does not restart
        assert peak["admitted"] <= (1 + 1 + 1) * 4
    finally:
        d.shutdown()


@pytest.mark.parametrize("eta, slow", [(1, {0}), (2, {0, 1})])
def test_no_episode_is_trained_more_than_max_staleness_versions_after_it_started(eta, slow):
    """The first episodes are slow: later ones finish first and fill batches, but a batch
    waits for them when taking it now would leave more of them at the end of their budget
    than the next batches hold (with eta 2, two slow episodes reached it in one batch)."""
    staleness = StalenessManager(
        max_staleness=eta, consumer_batch_size=1, max_concurrent_rollouts=3
    )

    async def episode(x):
        started = staleness.get_version()
        await asyncio.sleep(0.5 if x in slow else 0.01)
        return {"x": x, "started": started}

    d = RolloutDispatcher(episode, staleness)
    data, trained = iter(range(100)), []
    try:
        for version in range(6):
            staleness.set_version(version)
            d.wake()
            (result,) = d.prepare_batch(data, 1, timeout=30)
            trained.append((result["x"], version - result["started"]))
    finally:
        d.shutdown()
    assert trained[0][0] not in slow  # a later episode went first
    assert slow <= {x for x, _ in trained}
    assert 0 < max(late for _, late in trained) <= eta  # the slow ones: at most at its end


def test_a_batch_that_waits_for_a_hung_episode_at_its_budget_times_out_naming_it():
    staleness = StalenessManager(max_staleness=1, consumer_batch_size=1, max_concurrent_rollouts=2)

    async def episode(x):
        await asyncio.sleep(3600 if x == 0 else 0.01)
        return x

    d = RolloutDispatcher(episode, staleness)
    data = iter(range(100))
    try:
        assert d.prepare_batch(data, 1, timeout=30) == [1]
        staleness.set_version(1)
        d.wake()
        with pytest.raises(TimeoutError, match=r"1 running episode\(s\) near the end of their"):
            d.prepare_batch(data, 1, timeout=1)
    finally:
        d.shutdown()


def test_a_checkpoint_rereads_the_inputs_no_batch_has_used():
    staleness = StalenessManager(max_staleness=0, consumer_batch_size=2, max_concurrent_rollouts=4)

    async def episode(x):
        await asyncio.sleep(0.01)
        return None if x == 2 else x  # input 2 is turned away (e.g. dynamic sampling)

    d = RolloutDispatcher(episode, staleness)
    data = iter(range(100))
    try:
        assert d.prepare_batch(data, 2, timeout=30) == [0, 1]
        assert d.submitted >= 6 and d.inputs_to_reread() == d.submitted - 2  # 2 on: not used
        staleness.set_version(1)
        d.wake()
        assert d.prepare_batch(data, 2, timeout=30) == [3, 4]
        assert d.inputs_to_reread() == d.submitted - 5  # from 5 on; 2 was used up (rejected)
    finally:
        d.shutdown()


def test_rejections_are_counted_and_failures_name_the_episode():
    staleness = StalenessManager(0, 2, 4)

    async def episode(x):
        if x == 1:
            return None
        if x == 4:
            raise ZeroDivisionError("bad episode")
        return x

    d = RolloutDispatcher(episode, staleness)
    try:
        assert d.prepare_batch(iter([0, 1, 2]), 2, timeout=30) == [0, 2]
        assert staleness.snapshot()["rejected"] == 1
        staleness.set_version(1)
        with pytest.raises(
            EpisodeError,
            match=r"episode 4 failed: ZeroDivisionError: bad episode\n(.|\n)*Traceback",
        ):
            d.prepare_batch(iter([3, 4, 5, 6]), 2, timeout=30)
    finally:
        d.shutdown()


def test_paused_dispatcher_submits_nothing():
    staleness = StalenessManager(10, 10, 10)
    started = []

    async def episode(x):
        started.append(x)
        return x

    d = RolloutDispatcher(episode, staleness)
    try:
        d.pause()
        d.submit(1)
        with pytest.raises(TimeoutError, match="only 0 of 1 episodes"):
            d.wait_results(1, timeout=0.5)
        assert started == []
        d.resume()
        assert [r.result for r in d.wait_results(1, timeout=10)] == [1]
    finally:
        d.shutdown()


def test_stopping_the_episodes_cancels_the_running_ones_and_keeps_the_loop_for_closing():
    """A run's close ends its episodes before it closes what lives on their loop (the client,
    the session proxy): an episode running on would reopen the proxy (issue 46's stopped agent
    runs printed uvicorn's cancelled lifespan). None starts after, and the loop still runs."""
    staleness = StalenessManager(10, 10, 10)
    started, unwound = [], []

    async def episode(x):
        started.append(x)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            unwound.append(x)
            raise

    d = RolloutDispatcher(episode, staleness)
    try:
        for x in range(3):
            d.submit(x)
        deadline = time.monotonic() + 10
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        d.stop_episodes(timeout=10)
        assert sorted(unwound) == [0, 1, 2]  # cancelled and unwound before it returned
        d.submit(3)
        time.sleep(0.3)
        assert 3 not in started  # nothing starts after

        async def closing():
            return "closed on the episodes' loop"

        assert d.run_coroutine(closing(), timeout=5) == "closed on the episodes' loop"
    finally:
        d.shutdown()


def test_dynamic_sampling_keeps_the_batch_size_and_never_trains_on_a_filtered_group():
    """DAPO: groups with equal rewards are turned away and more prompts are drawn until the
    batch is full; the turned-away groups are counted and leave room under the staleness bound."""
    from tidal.rollout.workflows import has_reward_spread

    staleness = StalenessManager(max_staleness=0, consumer_batch_size=4, max_concurrent_rollouts=3)

    async def episode(x):  # every third prompt's group is all-correct: nothing to learn
        rewards = torch.ones(4) if x % 3 == 0 else torch.tensor([1.0, 0.0, 0.0, 1.0])
        return LLMBatch(
            input_ids=torch.zeros(4, 2, dtype=torch.long),
            attention_mask=torch.ones(4, 2, dtype=torch.bool),
            loss_mask=torch.ones(4, 2, dtype=torch.bool),
            logprobs=torch.zeros(4, 2),
            versions=torch.zeros(4, 2, dtype=torch.long),
            rewards=rewards,
        ), x

    d = RolloutDispatcher(episode, staleness, should_accept=lambda r: has_reward_spread(r[0]))
    try:
        batch = d.prepare_batch(range(100), 4, timeout=30)
        assert [x for _, x in batch] == [1, 2, 4, 5]
        assert all(has_reward_spread(b) for b, _ in batch)
        assert d.filtered >= 2 and staleness.snapshot()["rejected"] == d.filtered
    finally:
        d.shutdown()
