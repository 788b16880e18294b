import asyncio
import logging
import sys
import threading
import time

import pytest

from tidal.rollout.rewards import REWARDS, Reward, math_verify, register_reward, resolve_reward
from tidal.rollout.tasks import exact_match_reward

GSM8K_ANSWER = (
    "Tom has 3 boxes of 4 apples, so 3 * 4 = 12 apples.\nHe buys 60 more: 12 + 60 = 72.\n#### 72"
)


def test_builtins_are_registered():
    assert {"exact_match", "math_verify", "regex_match"} <= set(REWARDS.names())


def test_exact_match_kept_for_generated_tasks():
    assert exact_match_reward(completion="122 and more", answer="122") == 1.0
    assert exact_match_reward(completion="12", answer="122") == 0.0


@pytest.mark.parametrize(
    "kwargs, completion, expected",
    [
        ({}, "  42 \n", 1.0),
        ({}, "42 apples", 0.0),
        ({"first_word": True}, "42 apples", 1.0),
        ({"ignore_case": True}, "Paris", 1.0),
        ({}, "Paris", 0.0),
    ],
)
def test_exact_match(kwargs, completion, expected):
    answer = "paris" if "Paris" in completion else 42
    assert resolve_reward("exact_match", kwargs)(completion=completion, answer=answer) == expected


def test_regex_match_with_and_without_group():
    with_group = resolve_reward("regex_match", {"pattern": r"Answer: (-?\d+)"})
    assert with_group(completion="Answer: 3 ... no wait. Answer: -7", answer="-7") == 1.0
    assert (
        with_group(completion="Answer: -7 ... no wait. Answer: 3", answer="-7") == 0.0
    )  # last match counts
    assert with_group(completion="no answer here", answer="-7") == 0.0
    presence = resolve_reward("regex_match", {"pattern": r"^<think>.*</think>"})
    assert presence(completion="<think>hm</think> 4", answer="4") == 1.0
    assert presence(completion="4", answer="4") == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "reward.kwargs.pattern"),
        ({"pattern": "(unclosed"}, "reward.kwargs.pattern"),
    ],
)
def test_regex_match_bad_kwargs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward("regex_match", kwargs)


@pytest.mark.parametrize(
    "reference, completion, expected",
    [
        ("$\\frac{1}{2}$", "so the answer is \\boxed{0.5}", 1.0),
        ("\\frac{3}{4}", "We get $\\boxed{\\frac{6}{8}}$.", 1.0),
        (GSM8K_ANSWER, "3 * 4 = 12 and 12 + 60 = 72\n#### 72", 1.0),
        (GSM8K_ANSWER, "3 * 4 = 12 and 12 + 60 = 72 apples in total.", 1.0),
        (GSM8K_ANSWER, "3 * 4 = 12 and 12 + 50 = 62\n#### 62", 0.0),
        (
            GSM8K_ANSWER,
            "#### 72 is what a guess would say; the answer: 70",
            0.0,
        ),  # only the final answer
        ("#### 1,234", "The total is 1234.", 1.0),
        (GSM8K_ANSWER, "I do not know.", 0.0),
    ],
)
def test_math_verify_in_a_worker_thread(reference, completion, expected):
    """isolate=False runs math-verify in the calling thread: with its signal timeouts it would
    raise there; tidal calls it with them off."""
    out = []
    worker = threading.Thread(
        target=lambda: out.append(math_verify(completion, reference, isolate=False))
    )
    worker.start()
    worker.join(timeout=30)
    assert out == [expected]


@pytest.mark.parametrize(
    "completion, lenient, computed",
    [
        ("so Ben has 48 - 2 cookies left.", 1.0, 0.0),  # math-verify evaluates the expression
        ("\\boxed{40+6}", 1.0, 0.0),
        ("6 \\times 7 - 4", 0.0, 0.0),
        ("48 - 2 = 46 cookies are left.", 1.0, 1.0),  # the computed value is the final answer
        ("46", 1.0, 1.0),
        ("The answer is 46.", 1.0, 1.0),
        ("Ben has 48 - 2 = 40 cookies left.", 0.0, 0.0),
    ],
)
def test_math_verify_computed_only(completion, lenient, computed):
    assert math_verify(completion, "46", isolate=False) == lenient
    assert math_verify(completion, "46", isolate=False, computed_only=True) == computed


@pytest.mark.parametrize("answer", ["\\frac{1}{2}", "1/2", "-3", "0.5"])
def test_math_verify_computed_only_keeps_values(answer):
    """A fraction or a negative number is a value, not arithmetic left undone."""
    assert math_verify(f"So it is {answer}.", answer, isolate=False, computed_only=True) == 1.0


def test_math_verify_computed_only_in_the_child_process():
    strict = resolve_reward("math_verify", {"computed_only": True, "timeout_s": 60})
    lenient = resolve_reward("math_verify", {"timeout_s": 60})
    assert strict(completion="48 - 2", answer="46") == 0.0
    assert lenient(completion="48 - 2", answer="46") == 1.0
    assert strict(completion="46", answer="46") == 1.0


def test_math_verify_isolated_process_bounds_time_and_recovers():
    reward = resolve_reward("math_verify", {"timeout_s": 1e-4})
    with pytest.raises(TimeoutError, match="reward.kwargs.timeout_s"):
        reward(completion="\\boxed{72}", answer=GSM8K_ANSWER)  # the child cannot even start in time
    reward = resolve_reward("math_verify", {"timeout_s": 60})
    results = []
    threads = [
        threading.Thread(
            target=lambda c=c: results.append(reward(completion=c, answer=GSM8K_ANSWER))
        )
        for c in ("\\boxed{72}", "#### 71", "72")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0.0, 1.0, 1.0]


def test_math_verify_bad_timeout():
    with pytest.raises(ValueError, match="reward.kwargs.timeout_s"):
        resolve_reward("math_verify", {"timeout_s": 0})
    with pytest.raises(ValueError, match="reward.kwargs.computed_only: must be true or false"):
        resolve_reward("math_verify", {"computed_only": "yes"})


def test_unknown_names_and_modules_name_the_key():
    with pytest.raises(
        ValueError,
        match=r"reward.name.*'nope'.*exact_match, math_verify, regex_match.*; or give module",
    ):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="reward.name: cannot import module 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:score")
    with pytest.raises(
        ValueError, match="reward.name: module 'tidal.rollout.rewards' has no function 'nope'"
    ):
        resolve_reward("tidal.rollout.rewards:nope")
    with pytest.raises(ValueError, match="reward.name"):
        resolve_reward("tidal.rollout.rewards:")
    with pytest.raises(
        ValueError,
        match="reward.kwargs: reward 'exact_match' has no option no_such_option; "
        "its options: answer, first_word, ignore_case",
    ):
        resolve_reward("exact_match", {"no_such_option": 1})


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import asyncio\n"
        "def by_length(completion, target_len, scale=1.0, **record):\n"
        "    return scale * float(len(completion) == target_len + record['offset'])\n"
        "async def judge(completion, answer, **_):\n"
        "    await asyncio.sleep(0)\n"
        "    return 1.0 if answer in completion else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_user_function_gets_record_fields_and_kwargs(user_module):
    reward = resolve_reward("my_rewards:by_length", {"scale": 2.0})
    assert reward(completion="abcd", target_len=3, offset=1, id=7) == 2.0
    assert reward(completion="abc", target_len=3, offset=1, id=7) == 0.0
    with pytest.raises(
        ValueError, match="reward.kwargs: reward 'my_rewards:judge' does not accept"
    ):
        resolve_reward("my_rewards:judge", {"completion": "x", "extra": 1})


def test_async_reward_sync_and_async(user_module):
    reward = resolve_reward("my_rewards:judge")
    assert reward.is_async
    assert reward(completion="it is 42", answer="42") == 1.0
    assert asyncio.run(reward.ascore("it is 41", {"answer": "42", "id": 3}, timeout_s=5)) == 0.0


def test_ascore_counts_failures_and_logs_the_record_id(caplog):
    def broken(completion, **_):
        raise KeyError("boom")

    def slow(completion, **_):
        time.sleep(0.5)
        return 1.0

    def not_a_number(completion, **_):
        return "yes"

    async def run():
        out = []
        for fn in (broken, not_a_number):
            out.append(await Reward(fn.__name__, fn).ascore("x", {"id": "row-17"}, timeout_s=5))
        slow_reward = Reward("slow", slow)
        out.append(await slow_reward.ascore("x", {"id": "row-18"}, timeout_s=0.05))
        return out, slow_reward.counters

    with caplog.at_level(logging.WARNING, logger="tidal.rollout.rewards"):
        out, slow_counters = asyncio.run(run())
    assert out == [None, None, None]
    assert slow_counters.timeouts == 1 and slow_counters.errors == 0
    assert "row-17" in caplog.text and "row-18" in caplog.text and "returned 'yes'" in caplog.text


def test_register_reward_and_duplicate():
    @register_reward("test_always_one")
    def always_one(completion, **_):
        return 1

    assert resolve_reward("test_always_one")(completion="") == 1.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_always_one")(always_one)
