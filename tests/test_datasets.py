import importlib.util
import json
import re
from pathlib import Path

import pytest

from tidal.data.datasets import (
    DataConfigError,
    RecordIterator,
    check_conversations,
    check_prompts,
    load_conversations,
    load_prompts,
    load_table,
)

DATA = Path(__file__).resolve().parents[1] / "examples" / "llm" / "data"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hf-cache"


def test_example_train_jsonl(cache):
    table = load_prompts(DATA / "train.jsonl", cache, prompt_key="question", answer_key="answer")
    assert len(table) == 200 and set(table.column_names) == {"prompt", "answer", "id"}
    assert table["id"] == list(range(200))
    assert re.search(r"\n#### \d+$", table[0]["answer"])
    assert any(cache.rglob("*.arrow"))  # the Arrow cache went where it was told


def test_example_eval_parquet_is_held_out(cache):
    train = load_prompts(DATA / "train.jsonl", cache, prompt_key="question")
    held_out = load_prompts(
        DATA / "eval.parquet", cache, prompt_key="question", key="data.eval_path"
    )
    assert len(held_out) == 64
    assert not set(train["prompt"]) & set(held_out["prompt"])


def test_example_answers_are_worked_correctly():
    """Every step's arithmetic holds and the final line repeats the last result."""
    for line in (DATA / "train.jsonl").read_text().splitlines():
        steps, final = json.loads(line)["answer"].rsplit("\n#### ", 1)
        results = []
        for lhs, rhs in re.findall(r"(\d+ [-+*/] \d+) = (\d+)", steps):
            assert eval(lhs) == int(rhs), (lhs, rhs)  # noqa: S307 (digits and one operator)
            results.append(rhs)
        assert results[-1] == final


def test_generator_is_deterministic_and_unique():
    spec = importlib.util.spec_from_file_location(
        "make_word_problems", DATA / "make_word_problems.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    a, b = module.unique_problems(300, seed=3), module.unique_problems(300, seed=3)
    assert a == b and len({p["question"] for p in a}) == 300
    assert a != module.unique_problems(300, seed=4)
    first_lines = [json.loads(x) for x in (DATA / "train.jsonl").read_text().splitlines()[:5]]
    assert (
        module.unique_problems(5, seed=0) == first_lines
    )  # the committed file is the script's output


def test_generator_max_operand_caps_every_number_and_refuses_too_few_problems():
    spec = importlib.util.spec_from_file_location(
        "make_word_problems", DATA / "make_word_problems.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    easy = module.unique_problems(400, seed=0, max_operand=12)
    assert len({p["question"] for p in easy}) == 400

    def question_numbers(problems):  # "splits N equally into b bags" states a product: skipped
        return [
            int(x)
            for p in problems
            for x in re.findall(r"\d+", re.sub(r"splits \d+", "", p["question"]))
        ]

    # at most a sum of three drawn numbers ("had $a" = spent b + c + a tip of at most 12)
    assert max(question_numbers(easy)) <= 36
    assert max(question_numbers(module.unique_problems(400, seed=0))) > 36
    with pytest.raises(ValueError, match="distinct problems with max_operand=3"):
        module.unique_problems(400, seed=0, max_operand=3)


def test_generator_two_step_terse_problems_are_equations_alone():
    spec = importlib.util.spec_from_file_location(
        "make_word_problems", DATA / "make_word_problems.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # the easy recipe's size: four two-step templates have enough distinct questions under 9
    easy = module.unique_problems(4256, seed=0, max_operand=9, two_step=True, terse=True)
    assert len({p["question"] for p in easy}) == 4256
    worded = module.unique_problems(8, seed=0, max_operand=9, two_step=True)
    assert [p["question"] for p in worded] == [p["question"] for p in easy[:8]]
    for p in easy[:400]:
        *steps, final = p["answer"].split("\n")
        assert len(steps) == 2 and final == f"#### {steps[-1].split(' = ')[1]}"
        for step in steps:
            lhs, rhs = step.split(" = ")
            assert re.fullmatch(r"\d+ [-+*] \d+", lhs) and eval(lhs) == int(rhs)  # noqa: S307


def test_generator_dev_and_test_split_the_held_out_problems():
    spec = importlib.util.spec_from_file_location(
        "make_word_problems", DATA / "make_word_problems.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    held_out = module.unique_problems(10, seed=0)
    assert module.held_out_splits(held_out) == {"eval.parquet": held_out}
    splits = module.held_out_splits(held_out, dev_size=4)
    assert splits["eval.parquet"] == held_out
    assert splits["dev.parquet"] == held_out[:4] and splits["test.parquet"] == held_out[4:]


def test_example_sft_conversations(cache):
    table = load_conversations(DATA / "sft.jsonl", cache)
    roles = [[m["role"] for m in row] for row in table["messages"]]
    assert {tuple(r) for r in roles} == {
        ("system", "user", "assistant"),
        ("system", "user", "assistant", "user", "assistant"),
    }


def test_json_chat_prompts_and_other_fields_travel(tmp_path, cache):
    rows = [
        {
            "uid": f"q{i}",
            "chat": [{"role": "user", "content": f"{i}+{i}?"}],
            "ref": 2 * i,
            "level": i % 3,
        }
        for i in range(5)
    ]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    table = load_prompts(
        tmp_path / "d.json", cache, prompt_key="chat", answer_key="ref", id_key="uid"
    )
    assert table[3] == {
        "id": "q3",
        "prompt": [{"role": "user", "content": "3+3?"}],
        "answer": 6,
        "level": 0,
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"prompt_key": "prompt"},
            r"data.prompt_key: '.*train.jsonl' has no field 'prompt'; its fields: question, answer",
        ),
        (
            {"prompt_key": "question", "answer_key": "solution"},
            r"data.answer_key: '.*train.jsonl' has no field 'solution'; its fields: prompt, answer",
        ),
        ({"prompt_key": "question", "answer_key": None, "id_key": "answer"}, None),
    ],
)
def test_missing_keys_name_the_key_file_and_fields(cache, kwargs, message):
    if message is None:  # any field can serve as the id
        assert load_prompts(DATA / "train.jsonl", cache, **kwargs)[0]["id"].endswith("#### 39")
        return
    with pytest.raises(DataConfigError, match=message):
        load_prompts(DATA / "train.jsonl", cache, **kwargs)


def test_bad_files_name_the_config_key(tmp_path, cache):
    with pytest.raises(DataConfigError, match=r"data.eval_path: no such file '.*nope.jsonl'"):
        load_table(tmp_path / "nope.jsonl", cache, key="data.eval_path")
    with pytest.raises(
        DataConfigError,
        match=r"data.path: .*data.csv' is not a dataset file; expected one of .jsonl",
    ):
        load_table(tmp_path / "data.csv", cache)
    for name, text in (("empty.jsonl", ""), ("empty.json", "[]")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataConfigError, match=rf"data.path: .*{name}' holds no records"):
            load_table(tmp_path / name, cache)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"\n')
    with pytest.raises(DataConfigError, match=r"data.path: cannot read .*broken.jsonl"):
        load_table(tmp_path / "broken.jsonl", cache)


def test_bad_fields_name_the_config_key(tmp_path, cache):
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": 1, "answer": "1"}])
    with pytest.raises(
        DataConfigError,
        match="data.prompt_key: field 'prompt' .* expected a string or a list of chat",
    ):
        load_prompts(numbers, cache)
    holes = write_jsonl(
        tmp_path / "holes.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]
    )
    with pytest.raises(
        DataConfigError, match="data.prompt_key: field 'prompt' is empty in 1 of 2 records"
    ):
        load_prompts(holes, cache)
    both = write_jsonl(tmp_path / "both.jsonl", [{"q": "a", "prompt": "b", "answer": "1"}])
    with pytest.raises(DataConfigError, match="data.prompt_key: .* has both 'q' and 'prompt'"):
        load_prompts(both, cache, prompt_key="q")
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": "hello"}])
    with pytest.raises(
        DataConfigError, match="data.messages_key: field 'messages' .* expected a list of chat"
    ):
        load_conversations(chats, cache)


def test_iterator_shuffles_every_epoch_with_the_seed(cache):
    table = load_prompts(DATA / "eval.parquet", cache, prompt_key="question")
    first = [r["id"] for r in RecordIterator(table, seed=5).next_batch(128)]
    assert sorted(first[:64]) == sorted(first[64:]) == list(range(64))  # each epoch covers all once
    assert first[:64] != list(range(64)) and first[:64] != first[64:]  # shuffled, anew each epoch
    assert first == [r["id"] for r in RecordIterator(table, seed=5).next_batch(128)]
    assert first != [r["id"] for r in RecordIterator(table, seed=6).next_batch(128)]
    assert [r["id"] for r in RecordIterator(table, 5, shuffle=False).next_batch(3)] == [0, 1, 2]


def test_iterator_position_is_restored(cache):
    table = load_prompts(DATA / "eval.parquet", cache, prompt_key="question")
    it = RecordIterator(table, seed=1)
    it.next_batch(100)  # into the second epoch
    state = json.loads(json.dumps(it.state_dict()))  # it survives a JSON checkpoint
    expected = it.next_batch(50)
    resumed = RecordIterator(table, seed=999)
    resumed.load_state_dict(state)
    assert resumed.next_batch(50) == expected and resumed.epoch == 2
    with pytest.raises(
        DataConfigError, match="data.path: the checkpointed position is for 64 records"
    ):
        RecordIterator(table.select(range(10)), seed=1).load_state_dict(state)


def test_an_iterator_rewinds_over_records_read_but_not_used_even_across_epochs(cache):
    table = load_prompts(DATA / "eval.parquet", cache, prompt_key="question")  # 64 records
    it = RecordIterator(table, seed=1)
    it.next_batch(60)
    used_up_to_here = it.state_dict()
    read_ahead = it.next_batch(10)  # into the second epoch: queued or in flight at a save
    rewound = RecordIterator(table, seed=1)
    rewound.load_state_dict(it.state_dict(unread=10))
    assert rewound.state_dict() == used_up_to_here and rewound.next_batch(10) == read_ahead
    with pytest.raises(ValueError, match="unread: 71 records, but only 70 were read"):
        it.state_dict(unread=71)


def test_checks_before_the_run_folder_exists(tmp_path):
    assert check_prompts(DATA / "eval.parquet", prompt_key="question") == 64
    assert check_conversations(DATA / "sft.jsonl") == 24
    with pytest.raises(DataConfigError, match="data.eval_path: no such file"):
        check_prompts(tmp_path / "x.parquet", key="data.eval_path")
    with pytest.raises(DataConfigError, match="data.messages_key: .* has no field 'chat'"):
        check_conversations(DATA / "sft.jsonl", messages_key="chat")
