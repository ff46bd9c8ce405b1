"""The bundled instruction tasks: small, exactly checkable, deterministic by seed. `hf-mars bench` asks their
held-out split by default (answers known, so accuracy is reported beside speed) and `hf-mars demo` trains on
their training split; they live with the bench, which the demo builds on.

The demo needs tasks a ~1M-parameter character-level model can learn in CPU
minutes, whose answers can be checked by exact match, and whose tokens differ in
how predictable they are — so that tokens per forward differs by task, as in
the paper's per-task table:

- ``arith``: two-number addition written out digit by digit (GSM8K-like worked steps);
- ``copy`` / ``reverse`` / ``sort`` / ``count``: list and string manipulation;
- ``facts``: questions about a small fixed world (people, cities, pets, jobs)
  that the model must memorise; held-out questions pair people in combinations
  never asked in training, so they test recall, not copying of a seen answer;
- ``json`` / ``code``: structured output (a JSON record, a Python function template).

Every example is a chat-format ``{"messages": [user, assistant], "task": str}``
row (TRL's conversational format). Splits are decided by a hash of each
example's *key* (its prompt, or for ``facts`` the question's pair of people),
never by the seed, so the held-out split is disjoint from the training split of
any seed.
"""

from __future__ import annotations

import hashlib
import random
import string

TASKS = ("arith", "copy", "reverse", "sort", "count", "facts", "json", "code")

# --- the fixed world (independent of any seed: it is what the model memorises) ---
PEOPLE = ("Ada", "Ben", "Cal", "Dan", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon", "Kim", "Lea",
          "Max", "Ned", "Oli", "Pam", "Raj", "Sam", "Tom", "Uma", "Val", "Wes", "Yan", "Zoe")
CITIES = ("Oslo", "Rome", "Lima", "Kyiv", "Baku", "Doha", "Riga", "Bern")
PETS = ("cat", "dog", "owl", "fox", "rat", "yak")
JOBS = ("baker", "pilot", "nurse", "judge", "clerk", "actor")
_ATTRS = {"city": CITIES, "pet": PETS, "job": JOBS}


def _build_world() -> dict:
    rng = random.Random(20260407)  # fixed forever: changing it changes what the shipped base model knows
    return {p: {a: rng.choice(vals) for a, vals in _ATTRS.items()} for p in PEOPLE}


WORLD = _build_world()

# names, ages and identifiers used by the structured-output tasks (not part of the world)
_CODE_NAMES = ("area", "total", "ratio", "delta", "scale", "score", "merge", "step", "gain", "blend")
_CODE_OPS = (("plus", "+"), ("minus", "-"), ("times", "*"), ("over", "/"), ("mod", "%"))
_JSON_KEYS = ("name", "age", "city", "pet")

EVAL_FRACTION = 0.15


def _bucket(task: str, key: str) -> float:
    h = hashlib.sha256(f"{task}|{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def split_of(task: str, key: str) -> str:
    """``"eval"`` or ``"train"``: a fixed function of the example's key, so splits never overlap."""
    return "eval" if _bucket(task, key) < EVAL_FRACTION else "train"


# --- task generators: rng -> (key, prompt, answer, eval_ok) ---

def _arith(rng):
    a = rng.randint(10, 999)
    b = rng.randint(10, 99) if rng.random() < 0.5 else rng.randint(10, 999)
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        terms = [d[i] for d in (da, db) if i < len(d)]
        s = sum(int(t) for t in terms) + carry
        expr = "+".join(terms) + ("+1" if carry else "")
        steps.append(f"{expr}={s}")
        carry = s // 10
    answer = ", ".join(steps) + f", so {a + b}"
    prompt = f"{a}+{b}=?"
    return prompt, prompt, answer


def _letters(rng, lo, hi, alphabet=string.ascii_lowercase):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _copy(rng):
    s = _letters(rng, 4, 10)
    prompt = f"Copy: {s}"
    return prompt, prompt, s


def _reverse(rng):
    s = _letters(rng, 3, 8)
    prompt = f"Reverse: {s}"
    return prompt, prompt, s[::-1]


def _sort(rng):
    xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 7))]
    prompt = "Sort: " + " ".join(map(str, xs))
    return prompt, prompt, " ".join(map(str, sorted(xs)))


def _count(rng):
    target = rng.choice("abc")
    s = _letters(rng, 3, 7, alphabet="abc")
    prompt = f"Count {target} in {s}"
    return prompt, prompt, str(s.count(target))


_FACT_PHRASE = {
    "city": ("Where does {p} live?", "{p} lives in {v}."),
    "pet": ("What pet does {p} have?", "{p} has a {v}."),
    "job": ("What is {p}'s job?", "{p} is a {v}."),
}
_PAIR_PHRASE = {
    "city": ("Same city: {p} and {q}?", "{p} lives in {v}, {q} lives in {w}, so {yn}."),
    "pet": ("Same pet: {p} and {q}?", "{p} has a {v}, {q} has a {w}, so {yn}."),
    "job": ("Same job: {p} and {q}?", "{p} is a {v}, {q} is a {w}, so {yn}."),
}


def _facts(rng):
    """Single-fact questions teach the world (training split only); pair questions are the evaluated task."""
    attr = rng.choice(tuple(_ATTRS))
    if rng.random() < 0.25:
        p = rng.choice(PEOPLE)
        q_tpl, a_tpl = _FACT_PHRASE[attr]
        prompt = q_tpl.format(p=p)
        return None, prompt, a_tpl.format(p=p, v=WORLD[p][attr])  # key None: always training
    p, q = rng.sample(PEOPLE, 2)
    q_tpl, a_tpl = _PAIR_PHRASE[attr]
    v, w = WORLD[p][attr], WORLD[q][attr]
    answer = a_tpl.format(p=p, q=q, v=v, w=w, yn="yes" if v == w else "no")
    return f"{attr}|{'|'.join(sorted((p, q)))}", q_tpl.format(p=p, q=q), answer


def _json(rng):
    keys = rng.sample(_JSON_KEYS, rng.randint(2, 3))
    values = {"name": rng.choice(PEOPLE), "age": rng.randint(18, 89), "city": rng.choice(CITIES),
              "pet": rng.choice(PETS)}
    prompt = "JSON: " + ", ".join(f"{k} {values[k]}" for k in keys)
    body = ", ".join(f'"{k}": ' + (str(values[k]) if k == "age" else f'"{values[k]}"') for k in keys)
    return prompt, prompt, "{" + body + "}"


def _code(rng):
    name = rng.choice(_CODE_NAMES)
    x, y = rng.sample("abcdefghkmnpqrstuvwxyz", 2)
    word, op = rng.choice(_CODE_OPS)
    prompt = f"Def {name}: {x} {word} {y}"
    return prompt, prompt, f"def {name}({x}, {y}):\n    return {x} {op} {y}"


_GENERATORS = {"arith": _arith, "copy": _copy, "reverse": _reverse, "sort": _sort, "count": _count,
               "facts": _facts, "json": _json, "code": _code}


def make_example(task: str, rng: random.Random, split: str = "train") -> dict:
    """Draw one example of ``task`` that belongs to ``split`` (rejection-sampled on the key's hash)."""
    if task not in _GENERATORS:
        raise ValueError(f"Unknown task {task!r}; choose from {TASKS}.")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    for _ in range(10_000):
        key, prompt, answer = _GENERATORS[task](rng)
        example_split = "train" if key is None else split_of(task, key)
        if example_split == split:
            return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                    "task": task}
    raise RuntimeError(f"could not draw a {split!r} example of task {task!r}")  # pragma: no cover


def generate_examples(n: int, seed: int = 0, split: str = "train", tasks=TASKS) -> list[dict]:
    """``n`` examples, tasks interleaved round-robin (so every task has n/len(tasks) examples), deterministic by seed.

    Within the eval split, prompts are de-duplicated so each question is scored once.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    tasks = tuple(tasks)
    unknown = [t for t in tasks if t not in _GENERATORS]
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {tasks!r}.")
    rng = random.Random(f"hf-mars-data|{seed}|{split}")
    out, seen = [], set()
    i = 0
    while len(out) < n:
        task = tasks[i % len(tasks)]
        for _ in range(1000):
            ex = make_example(task, rng, split)
            prompt = ex["messages"][0]["content"]
            if split == "train" or prompt not in seen:
                break
        seen.add(prompt)
        out.append(ex)
        i += 1
    return out


def make_dataset(n: int, seed: int = 0, split: str = "train", tasks=TASKS):
    """The same examples as a `datasets.Dataset` (columns ``messages``, ``task``)."""
    from datasets import Dataset

    return Dataset.from_list(generate_examples(n, seed=seed, split=split, tasks=tasks))


def score(task: str, prediction: str, answer: str) -> bool:
    """Exact match of the whole answer (worked steps included), ignoring surrounding whitespace.

    Whole-answer matching is deliberately strict: a multi-token decoder that
    gets the final number right but garbles a step still counts as wrong.
    """
    if task not in _GENERATORS:
        raise ValueError(f"Unknown task {task!r}; choose from {TASKS}.")
    if not isinstance(prediction, str) or not isinstance(answer, str):
        raise ValueError("prediction and answer must be strings (decode token ids first).")
    return prediction.strip() == answer.strip()


def accuracy(tasks, predictions, answers) -> dict:
    """``{"overall": float, "per_task": {task: float}, "n": int}`` from parallel lists."""
    if not (len(tasks) == len(predictions) == len(answers)):
        raise ValueError("tasks, predictions and answers must have the same length.")
    per: dict[str, list[bool]] = {}
    for t, p, a in zip(tasks, predictions, answers):
        per.setdefault(t, []).append(score(t, p, a))
    hits = [h for v in per.values() for h in v]
    return {"overall": sum(hits) / max(len(hits), 1),
            "per_task": {t: sum(v) / len(v) for t, v in per.items()}, "n": len(hits)}
