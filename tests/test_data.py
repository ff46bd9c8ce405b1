"""The bundled instruction data: deterministic by seed, disjoint splits, exact answers, exact checker."""

import ast
import json
import re

import pytest

from hf_mars.bench import tasks as data
from hf_mars.bench.tasks import (
    TASKS,
    WORLD,
    generate_examples,
    make_example,
    score,
    split_of,
)


def _prompt(ex):
    return ex["messages"][0]["content"]


def _answer(ex):
    return ex["messages"][1]["content"]


def test_deterministic_by_seed():
    a = generate_examples(200, seed=3)
    b = generate_examples(200, seed=3)
    c = generate_examples(200, seed=4)
    assert a == b
    assert a != c
    assert generate_examples(64, seed=0, split="eval") == generate_examples(64, seed=0, split="eval")


def test_chat_format_and_task_mix():
    exs = generate_examples(80, seed=0)
    assert [ex["task"] for ex in exs[:len(TASKS)]] == list(TASKS)
    for ex in exs:
        assert set(ex) == {"messages", "task"}
        assert [m["role"] for m in ex["messages"]] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in ex["messages"])
    counts = {t: sum(ex["task"] == t for ex in exs) for t in TASKS}
    assert set(counts.values()) == {10}


@pytest.mark.parametrize("seed", [0, 1])
def test_splits_are_disjoint(seed):
    train = generate_examples(3000, seed=seed, split="train")
    held_out = generate_examples(400, seed=seed + 7, split="eval")
    train_prompts = {_prompt(ex) for ex in train}
    assert not train_prompts & {_prompt(ex) for ex in held_out}
    # eval prompts are unique, so each question is scored once
    assert len({_prompt(ex) for ex in held_out}) == len(held_out)
    # facts: a held-out question pairs two people never asked about together (in that attribute) in training
    pairs = lambda exs: {(ex["messages"][0]["content"].split(":")[0],) + tuple(sorted(re.findall(r"[A-Z][a-z]+", _prompt(ex).split(":")[1])))
                         for ex in exs if ex["task"] == "facts" and _prompt(ex).startswith("Same")}
    assert pairs(held_out) and not pairs(train) & pairs(held_out)


def test_split_of_is_a_fixed_function_of_the_key():
    keys = [f"k{i}" for i in range(2000)]
    frac = sum(split_of("copy", k) == "eval" for k in keys) / len(keys)
    assert 0.1 < frac < 0.2
    assert [split_of("copy", k) for k in keys] == [split_of("copy", k) for k in keys]


def _check_answer(task, prompt, answer):
    """An independent recomputation of each task's answer from its prompt."""
    if task == "arith":
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=\?", prompt).groups())
        assert answer.endswith(f", so {a + b}")
        for step in answer.split(", ")[:-1]:
            lhs, rhs = step.split("=")
            assert sum(map(int, lhs.split("+"))) == int(rhs)
    elif task == "copy":
        assert answer == prompt.removeprefix("Copy: ")
    elif task == "reverse":
        assert answer == prompt.removeprefix("Reverse: ")[::-1]
    elif task == "sort":
        xs = list(map(int, prompt.removeprefix("Sort: ").split()))
        assert answer == " ".join(map(str, sorted(xs)))
    elif task == "count":
        target, s = re.fullmatch(r"Count (\w) in (\w+)", prompt).groups()
        assert answer == str(s.count(target))
    elif task == "facts":
        names = re.findall(r"\b[A-Z][a-z]{2}\b", prompt)
        names = [n for n in names if n in WORLD]
        for n in names:
            assert n in answer
        if prompt.startswith("Same"):
            attr = prompt.split()[1].rstrip(":")
            p, q = names
            same = WORLD[p][attr] == WORLD[q][attr]
            assert answer.endswith("so yes." if same else "so no.")
            assert WORLD[p][attr] in answer and WORLD[q][attr] in answer
    elif task == "json":
        record = json.loads(answer)
        pairs = [kv.split(" ", 1) for kv in prompt.removeprefix("JSON: ").split(", ")]
        assert list(record) == [k for k, _ in pairs]
        assert {k: str(v) for k, v in record.items()} == dict(pairs)
    elif task == "code":
        name, x, word, y = re.fullmatch(r"Def (\w+): (\w) (\w+) (\w)", prompt).groups()
        tree = ast.parse(answer)
        fn = tree.body[0]
        assert fn.name == name and [a.arg for a in fn.args.args] == [x, y]
        op = dict(data._CODE_OPS)[word]
        assert answer.endswith(f"return {x} {op} {y}")
    else:  # pragma: no cover
        raise AssertionError(task)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_answers_are_correct(split):
    for ex in generate_examples(400, seed=5, split=split):
        _check_answer(ex["task"], _prompt(ex), _answer(ex))


def test_answers_are_short():
    """Character-level tokens: short answers keep the demo fast (max_new_tokens is 64)."""
    exs = generate_examples(2000, seed=0)
    assert max(len(_answer(ex)) for ex in exs) <= 60
    assert max(len(_prompt(ex)) for ex in exs) <= 60


def test_score_exact_match():
    assert score("arith", "3+4=7, so 7", "3+4=7, so 7")
    assert score("copy", " abc\n", "abc")  # surrounding whitespace is not content
    assert not score("copy", "abd", "abc")
    assert not score("arith", "3+4=8, so 7", "3+4=7, so 7")  # a wrong worked step fails the whole answer
    with pytest.raises(ValueError, match="Unknown task"):
        score("poetry", "a", "a")
    with pytest.raises(ValueError, match="strings"):
        score("copy", [1, 2], "ab")


def test_accuracy_per_task():
    acc = data.accuracy(["copy", "copy", "sort"], ["a", "b", "1 2"], ["a", "c", "1 2"])
    assert acc["overall"] == pytest.approx(2 / 3)
    assert acc["per_task"] == {"copy": 0.5, "sort": 1.0}
    with pytest.raises(ValueError, match="same length"):
        data.accuracy(["copy"], [], [])


def test_bad_arguments():
    import random

    with pytest.raises(ValueError, match="Unknown task"):
        make_example("poetry", random.Random(0))
    with pytest.raises(ValueError, match="split"):
        generate_examples(3, split="test")
    with pytest.raises(ValueError, match="tasks"):
        generate_examples(3, tasks=("copy", "nope"))


def test_world_is_fixed():
    """The shipped base model memorised this world: it must not change with code edits by accident."""
    assert len(WORLD) == len(data.PEOPLE) == 24
    assert WORLD["Ada"] == data._build_world()["Ada"]
    assert all(set(v) == {"city", "pet", "job"} for v in WORLD.values())
