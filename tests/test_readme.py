"""Every code block of README.md, run or checked, so that the README cannot drift from the code.

Python blocks
    Each ```python block runs as pasted: its text is compiled and executed in a fresh namespace (so a missing import
    or an undefined name fails), offline, with the block's working directory a fresh copy of the *reader's folder*:
    what a reader has after the README's earlier steps, built once here from local stand-ins:

        runs/demo/mars-checkpoint          `hf-mars demo --output-dir runs/demo`'s checkpoint. Stand-in: the shipped
                                           tiny AR-SFT base (hf_mars/demo/assets/tiny-base) with the mask token,
                                           saved by `save_for_hub`. Its mask is untrained, so τ < 1 output is noise
                                           here; its greedy answers are right, and only those are asserted.
        runs/qwen2.5-0.5b-mars             what the README's training commands write. Stand-in: the same checkpoint.
        runs/qwen2.5-0.5b-mars-bench.json  `hf-mars bench --output`. Stand-in: docs/demo_report.json (a demo
                                           report, the other layout `save_for_hub(benchmark=...)` reads).

    SUBSTITUTIONS rewrites the few things that cannot run here (Hub downloads, a 5-epoch training run, a fixed port)
    in a block's text before it runs; every entry must still match some block. A block that talks to a server
    (`127.0.0.1:8000`) gets the server the README starts for it: the first `transformers serve` / `hf-mars serve`
    line of the nearest bash block above it that has one, run by the test as written (on a free port, KEY set).
    A line `print(...)  # -> TEXT` asserts that TEXT is a line of the block's output.
    NOT_RUN lists the blocks that cannot run offline, with the reason; a block containing ILLUSTRATION is pure
    illustration. Both are compiled only. Any other block is run: a new block is never silently skipped.

Shell commands (bash blocks and inline code, in README.md and in every docs/*.md page it links its details to)
    Every `hf-mars <cmd>` exists (`hf-mars <cmd> --help` exits 0, run in this process through hf_mars.cli.main, the
    `hf-mars` entry point) and its help lists every --flag the README uses with it; every repository path the README
    names exists; every pip extra `.[name]` is defined in pyproject.toml. Other bash blocks (pip, accelerate, lm_eval)
    are only scanned for those paths and extras.

Torch runs with one thread here: on a shared 2-core machine tiny models decode ~10x faster than with two.
About 45 s on 2 cores, most of it the two servers booting and one MARSTrainer step (TRL's import).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from servers import free_port, stop_server

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # the README and the docs/ pages its sections point to
TINY_BASE = ROOT / "hf_mars" / "demo" / "assets" / "tiny-base"
KEY = "readme-test-key"


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


# (text in a README block, what runs instead): Hub names -> local stand-ins, an expensive argument -> a cheap one
SUBSTITUTIONS = [
    ('model="Qwen/Qwen2.5-0.5B-Instruct"', 'model="{tiny_base}"'),  # Hub model -> the shipped tiny base
    ('load_dataset("trl-lib/Capybara"', 'load_dataset("{dataset}"'),  # Hub dataset -> bundled chat rows, same format
    ("num_train_epochs=5", "max_steps=1"),  # one optimizer step, not five epochs
    ("127.0.0.1:8000", "127.0.0.1:{port}"),  # the free port the test's server listens on
]

# a substring that identifies the block -> why it is not run
NOT_RUN = {
    "push_to_hub(": "pushes to the Hugging Face Hub (network and a write token); tests/test_hub.py runs "
                   "push_to_hub against a stubbed Hub",
}
ILLUSTRATION = "# illustration, not run"

SERVE_LINE = re.compile(r"^(transformers|hf-mars) serve\s")
EXPECTED = re.compile(r"#\s*->\s*(.+?)\s*$")
REPO_PATH = re.compile(r"(?<![\w./-])((?:examples|benchmarks|docs|tests|hf_mars|model_cards|\.ci)/[\w./-]*[\w/])")


# --------------------------------------------------------------------------- reading the README


def _blocks(language: str, page: Path = README) -> list[tuple[int, str]]:
    """(line number, text) of every fenced block of ``language`` in ``page``."""
    out, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```" + language:
            start, i = i + 1, i + 1
            while lines[i].strip() != "```":
                i += 1
            out.append((start + 1, "\n".join(lines[start:i]) + "\n"))
        i += 1
    return out


PYTHON_BLOCKS = _blocks("python")
BASH_BLOCKS = _blocks("bash")


def _not_run_reason(text: str) -> str | None:
    if ILLUSTRATION in text:
        return "marked as illustration"
    reasons = [why for key, why in NOT_RUN.items() if key in text]
    return reasons[0] if reasons else None


def _server_line(line_no: int) -> str:
    """The first server command of the nearest bash block above README line ``line_no`` that starts one."""
    blocks = [[ln for ln in text.splitlines() if SERVE_LINE.match(ln)] for start, text in BASH_BLOCKS if start < line_no]
    blocks = [lines for lines in blocks if lines]
    assert blocks, f"the python block at README.md:{line_no} talks to 127.0.0.1:8000 but no server is started above it"
    return blocks[-1][0]


def _inline_code(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def _command_lines(pages: list[Path] = PAGES) -> list[str]:
    """Shell command lines of ``pages``: each bash line (continuations joined) and each inline code span."""
    lines = []
    for page in pages:
        for _, text in _blocks("bash", page):
            lines += text.replace("\\\n", " ").splitlines()
        lines += _inline_code(page)
    return lines


# --------------------------------------------------------------------------- the reader's folder


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread: tiny models on a shared 2-core machine run ~10x faster than with oversubscribed threads."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """The reader's folder (see the module docstring) and the local stand-ins for Hub names."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mars import add_mask_token, save_for_hub, set_mars_metadata
    from hf_mars.bench.tasks import generate_examples

    tmp = tmp_path_factory.mktemp("readme")
    reader = tmp / "reader"
    tokenizer = AutoTokenizer.from_pretrained(TINY_BASE)
    model = AutoModelForCausalLM.from_pretrained(TINY_BASE)
    add_mask_token(model, tokenizer)
    set_mars_metadata(model.config, block_size=4, trained_steps=1)  # a stand-in: save_for_hub needs the record
    ckpt = save_for_hub(model, tokenizer, reader / "runs" / "demo" / "mars-checkpoint")
    shutil.copytree(ckpt, reader / "runs" / "qwen2.5-0.5b-mars")
    shutil.copy(ROOT / "docs" / "demo_report.json", reader / "runs" / "qwen2.5-0.5b-mars-bench.json")

    dataset = tmp / "hub" / "trl-lib" / "Capybara"  # a local dataset folder: load_dataset reads train.jsonl
    dataset.mkdir(parents=True)
    with open(dataset / "train.jsonl", "w", encoding="utf-8") as f:
        for ex in generate_examples(8, seed=0, split="train"):
            f.write(json.dumps({"messages": ex["messages"]}) + "\n")
    return {"reader": reader, "tmp": tmp, "tiny_base": str(TINY_BASE), "dataset": str(dataset)}


def _env(tmp: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_HOME=str(tmp / "hf_home"), HF_MODULES_CACHE=str(tmp / "modules"), KEY=KEY, OMP_NUM_THREADS="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # transformers, hf-mars
    return env


@pytest.fixture(scope="module")
def servers(stand_ins):
    """Every server the README starts for a python block, run as written (port moved), all booting at once."""
    needed = sorted({_server_line(n) for n, text in PYTHON_BLOCKS
                     if "127.0.0.1:8000" in text and _not_run_reason(text) is None})
    env, procs, ports = _env(stand_ins["tmp"]), {}, {}
    for line in needed:
        port = free_port()
        cmd = line.split("  #")[0].strip()
        cmd = cmd.replace("--port 8000", f"--port {port}") if "--port" in cmd else f"{cmd} --port {port}"
        procs[line] = subprocess.Popen(["bash", "-c", "exec " + cmd], cwd=stand_ins["reader"], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ports[line] = port
    try:
        deadline = time.time() + 120
        for line, proc in procs.items():
            while True:  # up once it answers HTTP at all (401 without the key counts)
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{ports[line]}/v1/models", timeout=5).close()
                    break
                except urllib.error.HTTPError:
                    break
                except OSError:
                    if proc.poll() is not None or time.time() > deadline:
                        proc.kill()
                        pytest.fail(f"`{line}` did not start:\n" + (proc.stdout.read() or "")[-3000:])
                    time.sleep(0.3)
        yield ports
    finally:
        for proc in procs.values():
            stop_server(proc)


# --------------------------------------------------------------------------- python blocks


def _substitute(text: str, values: dict) -> str:
    for old, new in SUBSTITUTIONS:
        if old in text:
            text = text.replace(old, new.format(**values))
    return text


def test_substitutions_and_lists_are_live():
    """Each substitution and each NOT_RUN entry matches README text: no stale entry hides a change."""
    for old, _ in SUBSTITUTIONS:
        assert any(old in text for _, text in PYTHON_BLOCKS), f"substitution {old!r} matches no python block"
    for key in NOT_RUN:
        hits = [n for n, text in PYTHON_BLOCKS if key in text]
        assert len(hits) == 1, f"NOT_RUN key {key!r} must identify exactly one python block, found lines {hits}"
    assert PYTHON_BLOCKS and BASH_BLOCKS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line_no,text", PYTHON_BLOCKS, ids=[f"README.md:{n}" for n, _ in PYTHON_BLOCKS])
def test_python_block(line_no, text, request, monkeypatch, capsys):
    code = compile(text, f"README.md:{line_no}", "exec")  # every block at least parses
    reason = _not_run_reason(text)
    if reason is not None:
        pytest.skip(f"not run: {reason}")
    stand_ins = request.getfixturevalue("stand_ins")
    values = {k: v for k, v in stand_ins.items() if isinstance(v, str)}
    if "127.0.0.1:8000" in text:
        values["port"] = request.getfixturevalue("servers")[_server_line(line_no)]
        monkeypatch.setenv("KEY", KEY)
    source = _substitute(text, values)
    code = compile(source, f"README.md:{line_no}", "exec")

    # the reader's folder, fresh for this block; caches kept out of the user's home
    work = stand_ins["tmp"] / f"block-{line_no}"
    shutil.copytree(stand_ins["reader"], work)
    monkeypatch.chdir(work)
    request.getfixturevalue("modules_cache")  # remote code (custom_generate/) copied under tmp_path
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    if "load_dataset" in source:
        monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", work / ".datasets")

    capsys.readouterr()
    exec(code, {"__name__": "__main__"})
    printed = [ln.strip() for ln in capsys.readouterr().out.splitlines()]
    for expected in (m.group(1) for ln in text.splitlines() if (m := EXPECTED.search(ln))):
        assert expected in printed, f"README.md:{line_no} shows `{expected}`; the block printed {printed}"


def test_stand_in_greedy_answers_are_the_readme_outputs(stand_ins):
    """The shown outputs are greedy / lossless ones: the stand-in's plain greedy decoding gives each of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = stand_ins["reader"] / "runs" / "demo" / "mars-checkpoint"
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    shown = 0
    for _, text in PYTHON_BLOCKS:
        prompts = re.findall(r'"content": "([^"]+)"', text)
        outputs = [m.group(1) for ln in text.splitlines()
                   if (m := EXPECTED.search(ln)) and not re.fullmatch(r"(True|False)( (True|False))*", m.group(1))]
        if not prompts or not outputs:
            continue
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompts[0]}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        ids = model.generate(**inputs, max_new_tokens=64, do_sample=False)
        answer = tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        assert set(outputs) == {answer}, (prompts[0], outputs, answer)
        shown += 1
    assert shown >= 3


# --------------------------------------------------------------------------- shell commands


def _hf_mars_commands(pages: list[Path] = PAGES) -> list[list[str]]:
    """Token lists of every `hf-mars <sub-command> ...` in the command lines of ``pages``."""
    out = []
    for line in _command_lines(pages):
        for segment in re.split(r"&&|\|\||;|\|", line):
            try:
                tokens = shlex.split(segment, comments=True)
            except ValueError:  # an unbalanced quote in prose
                continue
            if len(tokens) >= 2 and tokens[0] == "hf-mars" and re.fullmatch(r"[a-z][a-z-]*", tokens[1]):
                out.append(tokens)
    return out


def test_hf_mars_commands_and_flags_exist(capsys):
    """`hf-mars <cmd> --help` exits 0 for every command the README names, and lists every flag used with it."""
    from hf_mars import cli

    scripts = _pyproject()["project"]["scripts"]
    assert scripts.get("hf-mars") == "hf_mars.cli:main"  # `hf-mars` is this entry point
    commands = _hf_mars_commands()
    assert {t[1] for t in _hf_mars_commands([README])} >= {"demo", "bench", "push", "serve"}
    helps = {}
    for tokens in commands:
        sub = tokens[1]
        if sub not in helps:
            with pytest.raises(SystemExit) as exit_info:
                cli.main([sub, "--help"])
            assert exit_info.value.code == 0, f"`hf-mars {sub} --help` exited {exit_info.value.code}"
            helps[sub] = capsys.readouterr().out
        flags = {t.strip("[]").split("=")[0] for t in tokens[2:] if t.strip("[]").startswith("--")}
        for flag in sorted(flags):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[sub]), \
                f"`hf-mars {sub}` has no {flag} (README: {' '.join(tokens)})"


def test_repository_paths_exist():
    """Every path under the repository's own folders that a command or code span names exists."""
    names = set()
    for line in _command_lines():
        names.update(REPO_PATH.findall(line))
    assert names
    # a dotted name such as `benchmarks/module.function` names a function of benchmarks/module.py
    missing = sorted(n for n in names if not (ROOT / n).exists() and not (ROOT / n).with_suffix(".py").is_file())
    assert not missing, f"README.md or docs/ name paths that do not exist: {missing}"


def test_pip_extras_exist():
    extras = _pyproject()["project"]["optional-dependencies"]
    used = {e for line in _command_lines() for group in re.findall(r'\.\[([\w,-]+)\]', line)
            for e in group.split(",")}
    assert used and used <= set(extras), f"README installs extras pyproject.toml does not define: {used - set(extras)}"


# --------------------------------------------------------------------------- links between the pages


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces -> hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    """Every relative link of the README and docs/ pages names a file that exists and, with #anchor, a heading of
    that page: the README's sections point to the docs their details moved to, and a renamed heading or moved page
    must not leave a dead link."""
    checked = 0
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(encoding="utf-8"),
                                                            flags=re.S), flags=re.M)
                assert anchor in {_anchor(h) for h in headings}, \
                    f"{page.relative_to(ROOT)} links to {target}: no such heading in {file.name}"
            checked += 1
    assert checked


# --------------------------------------------------------------------------- statements the README makes


def _prose(page: Path = README) -> str:
    """The page's text outside code blocks, on one line (statements wrap across lines)."""
    return " ".join(re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S).split())


def test_ci_jobs_are_the_ones_the_readme_counts():
    """The README says how many jobs `bash .ci/run` runs and names the files of its separate steps."""
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    jobs = re.findall(r'^echo "== (.+?) =="', script, flags=re.M)
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    prose = _prose()
    assert f"`bash .ci/run` builds fresh virtual environments and runs {words[len(jobs)]} jobs" in prose, jobs
    for test_file in ("tests/test_real_model.py", "tests/test_vllm.py", "tests/test_vllm_registered.py"):  # own steps
        assert (test_file in script) == (f"`{test_file}`" in prose), test_file


def test_an_explicit_tree_shape_with_sampling_is_accepted_as_the_readme_says(stand_ins):
    """README "Decode": an explicit draft-tree shape with sampling is accepted (with a warning; tests/test_tree.py
    checks the warning) and decodes, where the other cases it lists are errors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mars

    assert ("An explicit shape with sampling (`do_sample=True`) is accepted with a warning and decodes with the "
            "chain") in _prose()
    folder = stand_ins["reader"] / "runs" / "demo" / "mars-checkpoint"
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    inputs = tokenizer("Reverse: abc", return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=True,
                         custom_generate=hf_mars.mars_generate, mars_verify=True, mars_draft_tree="2,1")
    assert out.shape[1] == inputs["input_ids"].shape[1] + 6
    with pytest.raises(ValueError, match="cannot be used with"):  # beside a history-reading processor: an error
        model.generate(**inputs, max_new_tokens=6, repetition_penalty=1.5,
                       custom_generate=hf_mars.mars_generate, mars_verify=True, mars_draft_tree="2,1")
