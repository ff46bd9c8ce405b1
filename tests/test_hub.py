"""Hub-ready checkpoints: files, model card, push (offline) and loading by repo id without hf_mars.

The loading checks run in one subprocess in which hf_mars cannot be imported, against a
checkpoint laid out exactly as the HF cache holds a downloaded repo (HF_HUB_OFFLINE=1).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_mars import add_mask_token, custom_generate, hub, save_for_hub
from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2
from hf_mars.training.tokens import set_mars_metadata

REPO_ID = "mars-org/tiny-mars"
BLOCK = 4
PROMPTS = ["The quick brown fox", "hi"]
REPORT = {
    "block_size": BLOCK,
    "ar_sft": {"accuracy": 0.80},
    "mars": [
        {"threshold": 1.0, "accuracy": 0.82, "tokens_per_forward": 1.0, "speedup_vs_ar": 1.0},
        {"threshold": 0.9, "accuracy": 0.785, "tokens_per_forward": 2.13, "speedup_vs_ar": 1.61},
    ],
    "verify": {"accuracy": 0.82, "tokens_per_forward": 1.84},
}


def _tiny_mars(seed=0):
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=seed, hidden_size=32)
    add_mask_token(model, tok)
    set_mars_metadata(model.config, block_size=BLOCK, ar_weight=1.0, trained_steps=1)  # as MARSTrainer saves it
    return model, tok


def install_in_hf_cache(src: Path, hub_cache: Path, repo_id: str, commit: str = "c0ffee" * 6 + "abcd") -> Path:
    """Lay ``src`` out as huggingface_hub's cache holds a downloaded model repo (blobs, snapshot symlinks, refs).

    Only the files `hf-mars push` would commit are installed, so loading also proves that set complete.
    """
    repo_dir = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    for rel in hub.upload_file_list(src):
        f = src / rel
        blob = repo_dir / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, blob)
        link = snapshot / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, tokenizer, folder): a tiny random MARS model saved with save_for_hub."""
    model, tok = _tiny_mars()
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-mars"
    save_for_hub(model, tok, folder, base_model="Qwen/Qwen2.5-0.5B-Instruct", datasets=["openai/gsm8k"],
                 license="apache-2.0", benchmark=REPORT)
    return model, tok, folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model, tokenizer, output_dir) of a 2-step MARSTrainer run saving checkpoint-1, checkpoint-2 and save_model."""
    from hf_mars import MARSConfig, MARSTrainer
    from hf_mars.bench.tasks import make_dataset

    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, hidden_size=32)
    out = tmp_path_factory.mktemp("run") / "tiny-mars-run"
    args = MARSConfig(output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=4, report_to="none",
                      learning_rate=1e-3, use_cpu=True, max_length=128, block_size=BLOCK, disable_tqdm=True)
    trainer = MARSTrainer(model=model, args=args, train_dataset=make_dataset(8), processing_class=tok)
    trainer.train()
    trainer.save_model(str(out))
    return trainer.model.eval(), tok, out


# --------------------------------------------------------------------------- checkpoint contents


def test_checkpoint_files(saved):
    model, tok, folder = saved
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md",
                 "custom_generate/generate.py", "custom_generate/requirements.txt"):
        assert name in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))], files

    config = json.loads((folder / "config.json").read_text())
    mars = config["mars"]
    assert mars["mask_token"] == "<|mask|>" and mars["mask_token_id"] == tok.mask_token_id
    assert mars["block_size"] == BLOCK and mars["ar_weight"] == 1.0
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["mars_threshold"] == hub.DEFAULT_THRESHOLD and gen["mars_block_size"] == BLOCK
    assert gen["eos_token_id"] == tok.eos_token_id  # the original generation config is kept

    from transformers import AutoTokenizer, GenerationConfig

    assert GenerationConfig.from_pretrained(folder).mars_threshold == hub.DEFAULT_THRESHOLD  # survives loading
    reloaded = AutoTokenizer.from_pretrained(folder)
    assert reloaded.mask_token == "<|mask|>" and reloaded.mask_token_id == mars["mask_token_id"]

    # custom_generate/ holds the library's generation modules, byte for byte
    for module in hub.generation_package_files():
        assert (folder / "custom_generate" / module.name).read_bytes() == module.read_bytes()
    reqs = (folder / "custom_generate/requirements.txt").read_text().split()
    assert sorted(r.split(">=")[0] for r in reqs) == ["torch", "transformers"] and all(">=" in r for r in reqs)


def test_weights_get_the_umask_mode_like_the_other_files(request, tmp_path):
    """safetensors writes weights through a private temporary file (0600): save_for_hub and every MARSTrainer
    save give them the mode the umask gives config.json; a mode chosen otherwise is kept."""
    umask = os.umask(0)
    os.umask(umask)
    for source in ("saved", "trained"):
        top = request.getfixturevalue(source)[2]
        for folder in (top, *sorted(top.glob("checkpoint-*"))):
            modes = {p.name: p.stat().st_mode & 0o777 for p in (folder / "model.safetensors", folder / "config.json")}
            assert modes == {"model.safetensors": 0o666 & ~umask, "config.json": 0o666 & ~umask}, (folder, modes)
    folder = shutil.copytree(request.getfixturevalue("saved")[2], tmp_path / "copy")
    (folder / "model.safetensors").chmod(0o640)
    hub.write_mars_extras(folder)
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o640


def test_generation_module_is_standalone():
    """The copied modules import only torch, transformers, the stdlib and each other (they run without hf_mars)."""
    files = hub.generation_package_files()
    siblings = {p.stem for p in files}
    assert {"generate", "api", "config", "decoder", "rules"} <= siblings
    for module in files:
        custom_generate.check_standalone(module.read_text(), module, siblings)
    with pytest.raises(RuntimeError, match="may import only torch"):
        custom_generate.check_standalone("import numpy\ndef generate(*a, model, **k): pass\n", "x.py", siblings)
    with pytest.raises(RuntimeError, match="relative import"):  # hf_mars' own modules are not shipped
        custom_generate.check_standalone("from .tokens import x\ndef generate(*a, model, **k): pass\n", "x.py", siblings)
    with pytest.raises(RuntimeError, match="relative import"):  # transformers follows `from .x import` only
        custom_generate.check_standalone("from ..generation import api\n", "x.py", siblings)


def test_model_card_parses(saved):
    from huggingface_hub import ModelCard

    _, _, folder = saved
    card = ModelCard.load(folder / "README.md", ignore_metadata_errors=False)
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.base_model == "Qwen/Qwen2.5-0.5B-Instruct" and data.datasets == ["openai/gsm8k"]
    assert data.license == "apache-2.0"
    assert {"mars", "multi-token-prediction", "custom_generate"} <= set(data.tags)
    text = card.text
    assert "trust_remote_code=True" in text and "mars=True" in text  # both loading ways documented
    assert 'AutoModelForCausalLM.from_pretrained("' + hub.REPO_ID_PLACEHOLDER + '")' in text
    # the measured table: one row per tau, accuracy and tokens per forward
    assert "| MARS | 0.9 | 78.5% | 2.13 | 1.61× |" in text
    assert "| MARS (one-token mode) | 1 | 82.0% | 1.00 | 1.00× |" in text
    assert "| AR SFT baseline (a separate AR-trained model) | – | 80.0% | 1.00 | – |" in text and "1.84" in text
    assert "| MARS block size B | 4 |" in text


def test_model_card_training_args_and_existing_metadata(saved, tmp_path):
    from huggingface_hub import ModelCard
    from transformers import TrainingArguments

    _, _, folder = saved
    ckpt = tmp_path / "checkpoint-10"
    shutil.copytree(folder, ckpt)
    # a card written earlier (e.g. TRL's) keeps its metadata when no card fields are passed
    (ckpt / "README.md").write_text("---\nbase_model: org/base\ndatasets:\n- org/data\nlicense: mit\ntags:\n- trl\n---\nold\n")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 10, "epoch": 0.5}))
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["mars_threshold"] = 0.8  # a user-set default survives a rewrite
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=3e-5, num_train_epochs=2,
                             per_device_train_batch_size=8, gradient_accumulation_steps=4, report_to="none")
    hub.write_mars_extras(ckpt, training_args=args)
    card = ModelCard.load(ckpt / "README.md")
    assert card.data.base_model == "org/base" and card.data.datasets == ["org/data"] and card.data.license == "mit"
    assert {"trl", "mars"} <= set(card.data.tags)
    for row in ("| learning rate | 3e-05 |", "| epochs | 2 |", "| batch size per device | 8 |",
                "| gradient accumulation steps | 4 |", "| optimizer steps done | 10 |"):
        assert row in card.text, row
    assert "mars_threshold=0.8" in card.text
    assert json.loads((ckpt / "generation_config.json").read_text())["mars_threshold"] == 0.8

    # MARS fields of a MARSConfig-like object are listed too; explicit defaults win
    hub.write_mars_extras(ckpt, training_args={"mars_block_size": 4, "mars_mask_loss_weight": 0.5, "learning_rate": 1e-4},
                          mars_threshold=0.9, mars_block_size=2)
    text = (ckpt / "README.md").read_text()
    assert "| mars mask loss weight | 0.5 |" in text and "| learning rate | 0.0001 |" in text
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["mars_threshold"] == 0.9 and gen["mars_block_size"] == 2
    assert "mars_draft_tree" not in gen  # only a measured choice is saved; unset means 'auto'

    # a draft-tree shape measured for this checkpoint is saved with the generation defaults, and decoding reads it
    hub.write_mars_extras(ckpt, mars_draft_tree=[2, 1])
    assert json.loads((ckpt / "generation_config.json").read_text())["mars_draft_tree"] == "2,1"
    from transformers import GenerationConfig

    from hf_mars.generation import MARSGenerationConfig

    opts = MARSGenerationConfig.resolve(None, GenerationConfig.from_pretrained(ckpt), mars_verify=True)
    assert opts.draft_tree == "2,1" and "draft_tree" not in opts._from_call  # a saved default, not the call's

    # so is a draft vocabulary: verify calls read it, threshold-mode calls leave it (it would change their output)
    hub.write_mars_extras(ckpt, mars_draft_vocab=[7, 5, 7, 9])
    assert json.loads((ckpt / "generation_config.json").read_text())["mars_draft_vocab"] == [7, 5, 9]
    card_text = (ckpt / "README.md").read_text()
    assert "| verify mode's draft vocabulary (`mars_draft_vocab`) | 3 token ids" in card_text
    assert "| verify mode's draft layout (`mars_draft_tree`) | `2,1` |" in card_text
    saved_config = GenerationConfig.from_pretrained(ckpt)
    assert MARSGenerationConfig.resolve(None, saved_config, mars_verify=True).draft_vocab == (7, 5, 9)
    assert MARSGenerationConfig.resolve(None, saved_config, mars_threshold=0.9).draft_vocab is None  # (and the
    # saved tree, which uses the last mask, one deeper than a threshold call has, does not refuse that call)


def test_card_field_errors(saved, tmp_path):
    model, tok, _ = saved
    with pytest.raises(ValueError, match="Unknown model-card field"):
        save_for_hub(model, tok, tmp_path / "x", base_modle="typo/name")
    with pytest.raises(ValueError, match="report dict"):
        save_for_hub(model, tok, tmp_path / "y", benchmark={"accuracy": 1.0})
    with pytest.raises(ValueError, match=r"mars_threshold must be a number in \[0, 1\]"):
        save_for_hub(model, tok, tmp_path / "z", mars_threshold=2.0)
    with pytest.raises(ValueError, match="mars_block_size must be an int"):
        save_for_hub(model, tok, tmp_path / "w", mars_block_size=0)
    with pytest.raises(ValueError, match="namespace/name"):
        save_for_hub(model, tok, tmp_path / "v", repo_id="no-namespace")
    with pytest.raises(ValueError, match="mars_draft_tree must be"):
        save_for_hub(model, tok, tmp_path / "u", mars_draft_tree="0,2")
    with pytest.raises(ValueError, match="mars_draft_vocab must be a non-empty list"):
        save_for_hub(model, tok, tmp_path / "t", mars_draft_vocab=[])
    with pytest.raises(ValueError, match="outside this model's"):
        save_for_hub(model, tok, tmp_path / "s", mars_draft_vocab=[1, 10 ** 7])
    assert not any((tmp_path / d).exists() for d in "xyzwvuts")  # nothing written for bad input


# --------------------------------------------------------------------------- not a MARS checkpoint


def test_save_for_hub_rejects_non_mars(tmp_path):
    tok = build_char_tokenizer()
    plain = tiny_qwen2(tok, hidden_size=32)
    with pytest.raises(ValueError, match="not a MARS checkpoint"):
        save_for_hub(plain, tok, tmp_path / "a")
    model, mtok = _tiny_mars()
    with pytest.raises(ValueError, match="tokenizer has no mask token"):
        save_for_hub(model, build_char_tokenizer(), tmp_path / "b")  # the tokenizer add_mask_token did not touch
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_push_rejects_non_mars_folders(saved, tmp_path):
    model, tok, folder = saved
    plain_dir = tmp_path / "plain"
    tok0 = build_char_tokenizer()
    tiny_qwen2(tok0, hidden_size=32).save_pretrained(plain_dir)
    tok0.save_pretrained(plain_dir)
    with pytest.raises(ValueError, match="not a MARS checkpoint.*no `mars` metadata"):
        hub.push_to_hub(plain_dir, REPO_ID, dry_run=True)
    with pytest.raises(ValueError, match="not a MARS checkpoint"):
        hub.write_mars_extras(plain_dir)

    no_mask = tmp_path / "no-mask"
    shutil.copytree(folder, no_mask)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_mask / name).unlink()
    tok0.save_pretrained(no_mask)  # a tokenizer without the mask token
    with pytest.raises(ValueError, match="no mask token"):
        hub.push_to_hub(no_mask, REPO_ID, dry_run=True)

    pickled = tmp_path / "pickled"
    shutil.copytree(folder, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no safetensors weights"):
        hub.push_to_hub(pickled, REPO_ID, dry_run=True)

    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    shutil.rmtree(bare / "custom_generate")
    with pytest.raises(ValueError, match="write_mars_extras"):
        hub.push_to_hub(bare, REPO_ID, dry_run=True)
    (bare / "custom_generate").mkdir()
    (bare / "custom_generate/generate.py").write_text("import hf_mars\ndef generate(*a, model, **k): pass\n")
    with pytest.raises(ValueError, match="may import only torch"):
        hub.push_to_hub(bare, REPO_ID, dry_run=True)
    with pytest.raises(ValueError, match="not a directory"):
        hub.push_to_hub(tmp_path / "missing", REPO_ID, dry_run=True)


# --------------------------------------------------------------------------- push


@pytest.fixture
def no_network(monkeypatch):
    """Any Hub call fails the test: validation must happen before the network."""
    from huggingface_hub import HfApi

    def boom(*a, **k):
        raise AssertionError("network call made")

    for name in ("create_repo", "create_branch", "upload_folder", "create_commit", "whoami"):
        monkeypatch.setattr(HfApi, name, boom)


@pytest.mark.parametrize("repo_id", ["tiny-mars", "a/b/c", "/tiny", "org/", "org/na me", "org/a--b", "org/x.git",
                                     "", None, "datasets/org/x"])
def test_bad_repo_ids_rejected_before_network(saved, repo_id, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError, match="namespace/name"):
        hub.push_to_hub(saved[2], repo_id, token="hf_fake")
    with pytest.raises(ValueError, match="namespace/name"):
        hub.push_to_hub("/does/not/exist", repo_id, token="hf_fake")  # the repo id is checked first


def _with_training_junk(folder: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "checkpoint-5"
    shutil.copytree(folder, ckpt)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json",
                 "custom_generate/__pycache__/generate.cpython-311.pyc", ".git/config", "global_step5/mp_rank_00.pt",
                 "checkpoint-3/model.safetensors", "checkpoint-3/config.json"):
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_bytes(b"x")
    return ckpt


EXPECTED_FILES = sorted(["README.md", "chat_template.jinja", "config.json", "custom_generate/requirements.txt",
                         "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
                        + [f"custom_generate/{name}.py" for name in (
                            "_compat", "acceptor", "api", "cache", "call_record", "clients", "config", "cost", "decoder",
                            "draft_vocab", "forward", "generate", "history", "limits", "model_calls", "outputs", "plan",
                            "policy", "prompt", "proposers", "row_tensors", "rules", "state", "tree")])


def test_dry_run_lists_exactly_what_upload_folder_commits(saved, tmp_path, monkeypatch, no_network):
    from huggingface_hub import HfApi
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    ckpt = _with_training_junk(saved[2], tmp_path)
    files = hub.push_to_hub(ckpt, REPO_ID, dry_run=True)
    assert files == EXPECTED_FILES
    # huggingface_hub's own listing with the patterns push passes to upload_folder (its YAML check is remote)
    monkeypatch.setattr(HfApi, "_validate_yaml", lambda self, *a, **k: None)
    ops = HfApi()._prepare_upload_folder_additions(
        ckpt, path_in_repo="", ignore_patterns=hub.PUSH_IGNORE_PATTERNS + DEFAULT_IGNORE_PATTERNS)
    assert [op.path_in_repo for op in ops] == files
    assert (ckpt / "README.md").read_text() == (saved[2] / "README.md").read_text()  # dry run changes nothing


def test_cli_dry_run(saved, tmp_path, capsys, no_network):
    from hf_mars.cli import main

    ckpt = _with_training_junk(saved[2], tmp_path)
    assert main(["push", str(ckpt), "--repo-id", REPO_ID, "--dry-run", "--revision", "v1", "--create-pr"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == EXPECTED_FILES
    assert f"would commit {len(EXPECTED_FILES)} files to {REPO_ID}@v1 (as a pull request)" in out.err
    assert main(["push", str(ckpt), "--repo-id", "no-namespace", "--dry-run"]) == 2
    assert "namespace/name" in capsys.readouterr().err


def test_push_calls_hub(saved, tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **k: calls.append(("create_repo", repo_id, k)))
    monkeypatch.setattr(HfApi, "create_branch", lambda self, repo_id, **k: calls.append(("create_branch", repo_id, k)))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **k: calls.append(("upload_folder", self.token, k)) or "url")
    ckpt = _with_training_junk(saved[2], tmp_path)
    assert hub.push_to_hub(ckpt, REPO_ID, private=True, revision="v1", token="hf_fake", commit_message="msg") == "url"
    (n1, repo, k1), (n2, _, k2), (n3, token, k3) = calls
    assert (n1, n2, n3) == ("create_repo", "create_branch", "upload_folder") and repo == REPO_ID and token == "hf_fake"
    assert k1["private"] is True and k1["exist_ok"] is True and k2["branch"] == "v1"
    assert k3["repo_id"] == REPO_ID and k3["revision"] == "v1" and k3["commit_message"] == "msg"
    assert k3["ignore_patterns"] == hub.PUSH_IGNORE_PATTERNS and Path(k3["folder_path"]) == ckpt
    # the card's usage snippets now name the repo
    text = (ckpt / "README.md").read_text()
    assert hub.REPO_ID_PLACEHOLDER not in text and f'from_pretrained("{REPO_ID}")' in text


def test_push_offline_unauthenticated_unreachable(saved, monkeypatch):
    import huggingface_hub

    folder = saved[2]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="offline mode is on.*HF_HUB_OFFLINE=0"):
        hub.push_to_hub(folder, REPO_ID, token="hf_fake")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(RuntimeError, match="not logged in.*hf auth login.*HF_TOKEN"):
        hub.push_to_hub(folder, REPO_ID)

    # a closed local port: a real connection error, reported as such
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(RuntimeError, match="Cannot reach the Hugging Face Hub"):
        hub.push_to_hub(folder, REPO_ID, token="hf_fake")


# --------------------------------------------------------------------------- loading by repo id, no hf_mars

LOADER = textwrap.dedent(r'''
    import importlib.abc, json, sys

    class _BlockHfMars(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_mars" or name.startswith("hf_mars."):
                raise ModuleNotFoundError(f"hf_mars is blocked in this process ({name})")

    sys.meta_path.insert(0, _BlockHfMars())
    sys.modules["hf_mars"] = None
    res = {}
    try:
        import hf_mars  # noqa: F401
        res["hf_mars_blocked"] = False
    except ImportError:
        res["hf_mars_blocked"] = True

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    repo, enc, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    tok = AutoTokenizer.from_pretrained(repo)
    res["tokenizer_ids"] = tok(enc["prompts"], padding=True)["input_ids"]
    res["mask_token_id"] = tok.mask_token_id
    # token ids come from the parent process, so the checks below do not depend on the tokenizer round trip
    batch = {k: torch.tensor(v) for k, v in enc["batch"].items()}
    single = {k: torch.tensor(v) for k, v in enc["single"].items()}
    prompts = enc["prompts"]

    plain = AutoModelForCausalLM.from_pretrained(repo)
    res["plain_generate_is_method"] = getattr(plain.generate, "__func__", None) is type(plain).generate
    res["greedy"] = plain.generate(**batch, max_new_tokens=new, do_sample=False).tolist()
    try:
        plain.generate(**single, max_new_tokens=2, do_sample=False, mars=True)
        res["plain_rejects_mars"] = False
    except (ValueError, TypeError) as e:
        res["plain_rejects_mars"] = "mars" in str(e)

    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    res["custom_module"] = getattr(getattr(model.generate, "func", None), "__module__", None)
    res["defaults"] = [model.generation_config.mars_threshold, model.generation_config.mars_block_size]
    res["mars_tau1"] = model.generate(**batch, max_new_tokens=new, do_sample=False, mars=True,
                                      mars_threshold=1.0).tolist()
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    out = model.generate(**single, max_new_tokens=new, do_sample=False, mars=True, mars_threshold=0.0,
                         return_dict_in_generate=True)
    hook.remove()
    res["tau0_forwards"] = len(calls)
    res["tau0_new_tokens"] = out.sequences.shape[1] - single["input_ids"].shape[1]
    res["tau0_stats"] = [out.mars_forward_passes.tolist(), out.mars_emitted_tokens.tolist()]

    pipe = pipeline("text-generation", model=repo, trust_remote_code=True)
    res["pipe_mars"] = pipe(prompts[0], max_new_tokens=new, do_sample=False, mars=True, mars_threshold=1.0,
                            return_full_text=False)[0]["generated_text"]
    res["pipe_plain"] = pipeline("text-generation", model=repo)(prompts[0], max_new_tokens=new, do_sample=False,
                                                                return_full_text=False)[0]["generated_text"]
    res["modules_loaded"] = sorted(m for m in sys.modules if m.startswith("hf_mars") and sys.modules[m] is not None)
    print("RESULT " + json.dumps(res))
''')


@pytest.fixture(scope="module", params=["save_for_hub", "MARSTrainer.save_model"])
def source(request):
    """(model, tokenizer, folder): a checkpoint written by save_for_hub, or by MARSTrainer.save_model."""
    return request.getfixturevalue("saved" if request.param == "save_for_hub" else "trained")


@pytest.fixture(scope="module")
def loaded(source, tmp_path_factory):
    """Run LOADER once per source in a fresh interpreter: offline HF cache, repo id, hf_mars unimportable."""
    _, _, folder = source
    home = tmp_path_factory.mktemp("hf_home")
    install_in_hf_cache(folder, home / "hub", REPO_ID)
    script = home / "loader.py"
    script.write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "PYTHONPATH"))}
    env.update(HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"), HF_MODULES_CACHE=str(home / "modules"),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    _, tok, _ = source
    enc = {"prompts": PROMPTS, "batch": dict(tok(PROMPTS, padding=True)), "single": dict(tok(PROMPTS[:1]))}
    proc = subprocess.run([sys.executable, str(script), REPO_ID, json.dumps(enc), "24"], cwd=home, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_loaded_without_hf_mars(loaded):
    assert loaded["hf_mars_blocked"] and loaded["modules_loaded"] == []
    # generate comes from the checkpoint's custom_generate/generate.py, copied into HF_MODULES_CACHE
    assert loaded["custom_module"].startswith("transformers_modules.") and "custom_generate" in loaded["custom_module"]
    assert loaded["defaults"] == [hub.DEFAULT_THRESHOLD, BLOCK]


def test_loaded_tau1_equals_greedy(loaded, source):
    assert loaded["mars_tau1"] == loaded["greedy"]
    # and the greedy reference is the original model's greedy output
    model, tok, _ = source
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    assert model.generate(**batch, max_new_tokens=24, do_sample=False).tolist() == loaded["greedy"]


def test_loaded_tokenizer_matches(loaded, source):
    """AutoTokenizer on the repo id encodes as the tokenizer the model was trained with."""
    _, tok, _ = source
    assert loaded["mask_token_id"] == tok.mask_token_id
    assert loaded["tokenizer_ids"] == tok(PROMPTS, padding=True)["input_ids"]


def test_loaded_tau0_takes_fewer_forwards(loaded):
    forwards, new = loaded["tau0_forwards"], loaded["tau0_new_tokens"]
    assert new >= 12, loaded
    assert forwards < new, loaded  # counted with a forward hook, prefill included
    print(f"tau=0: {new} tokens in {forwards} forwards")
    assert loaded["tau0_stats"][0][0] <= forwards and loaded["tau0_stats"][1][0] > loaded["tau0_stats"][0][0]


def test_loaded_plain_is_ar(loaded):
    assert loaded["plain_generate_is_method"]  # no remote code: the class's own generate
    assert loaded["plain_rejects_mars"]  # and it knows nothing of MARS arguments


def test_pipeline_with_mars_args(loaded):
    assert loaded["pipe_mars"] == loaded["pipe_plain"] and len(loaded["pipe_mars"]) > 0


# --------------------------------------------------------------------------- MARSTrainer checkpoints


def test_trainer_checkpoints_are_hub_ready(trained, tmp_path, modules_cache):
    """Every folder MARSTrainer saves (checkpoint-N and save_model) is a complete MARS Hub checkpoint."""
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    _, tok, out = trained
    for folder in (out / "checkpoint-1", out / "checkpoint-2", out):
        mars = hub.check_checkpoint(folder, for_push=True)
        assert mars["block_size"] == BLOCK and mars["mask_token_id"] == tok.mask_token_id
        for module in hub.generation_package_files():
            assert (folder / "custom_generate" / module.name).read_bytes() == module.read_bytes()
        card = ModelCard.load(folder / "README.md")
        assert {"mars", "custom_generate"} <= set(card.data.tags)
        assert "| learning rate | 0.001 |" in card.text and "| max steps | 2 |" in card.text
        files = hub.push_to_hub(folder, REPO_ID, dry_run=True)
        assert "model.safetensors" in files and not [f for f in files if f.endswith((".bin", ".pt", ".pth"))]
        assert "trainer_state.json" not in files and not [f for f in files if f.startswith("checkpoint-")]

    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert loaded.generate.func.__module__.startswith("transformers_modules.")
    plain = AutoModelForCausalLM.from_pretrained(out)
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    greedy = plain.generate(**batch, max_new_tokens=16, do_sample=False)
    torch.testing.assert_close(loaded.generate(**batch, max_new_tokens=16, do_sample=False, mars=True,
                                               mars_threshold=1.0), greedy)


def test_card_usage_snippets_run(saved, tmp_path, monkeypatch, modules_cache):
    """The card's usage code is valid Python whatever the prompt holds, and its MARS snippets run as written."""
    import ast
    import re

    model, tok, _ = saved
    folder = save_for_hub(model, tok, tmp_path / "c", repo_id=REPO_ID, example_prompt='Say "hi"\nthen {stop}')
    text = (folder / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 4
    for block in blocks:
        ast.parse(block)
    assert f'repo = "{REPO_ID}"' in text and hub.REPO_ID_PLACEHOLDER not in text
    assert '"content": "Say \\"hi\\"\\nthen {stop}"' in text
    for block in blocks[:2]:  # trust_remote_code generate, then the pipeline (the local folder stands in for the repo)
        code = block.replace(f'"{REPO_ID}"', repr(str(folder))).replace("max_new_tokens=256", "max_new_tokens=8")
        exec(compile(code, "README.md", "exec"), {})
