"""A real client: lm-evaluation-harness evaluates a MARS checkpoint with MARS decoding.

Equivalent to
  lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --device cpu \
      --tasks mars_tiny --include_path TASKDIR --gen_kwargs mars=True,mars_threshold=0.0
through the Python API, so that the model lm-eval loaded can be watched (forward hook).
"""

import json
import textwrap

import pytest

lm_eval = pytest.importorskip("lm_eval")

from hf_mars import add_mask_token, save_for_hub  # noqa: E402
from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2  # noqa: E402
from hf_mars.training.tokens import set_mars_metadata  # noqa: E402

ROWS = [
    {"question": "Repeat: abcabcabc", "answer": "abcabcabc"},
    {"question": "Count to five: 1 2 3", "answer": "4 5"},
    {"question": "The quick brown fox", "answer": "jumps"},
    {"question": "hi", "answer": "hello"},
]


def _task_dir(tmp_path):
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    data = task_dir / "mars_tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (task_dir / "mars_tiny.yaml").write_text(textwrap.dedent(f"""\
        task: mars_tiny
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n\\n"]
          max_gen_toks: 24
          do_sample: false
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        metadata:
          version: 1.0
        """))
    return task_dir


def test_lm_eval_hf_backend_uses_mars(tmp_path, monkeypatch, modules_cache):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "datasets")  # the task's json cache
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=1, hidden_size=32)
    add_mask_token(model, tok)
    set_mars_metadata(model.config, block_size=4, ar_weight=1.0, trained_steps=1)  # as MARSTrainer saves it
    ckpt = tmp_path / "ckpt"
    save_for_hub(model, tok, ckpt)

    # what `--model hf --model_args pretrained=DIR,trust_remote_code=True --device cpu` builds
    lm = HFLM(pretrained=str(ckpt), trust_remote_code=True, device="cpu", batch_size=2)
    assert lm.model.generate.func.__module__.startswith("transformers_modules.")  # the checkpoint's custom_generate
    seen, forwards = [], []
    custom = lm.model.generate

    def spy(*args, **kwargs):
        out = custom(*args, **kwargs)
        seen.append((kwargs.get("mars"), kwargs.get("mars_threshold"), out.shape[1] - kwargs["input_ids"].shape[1],
                     kwargs["input_ids"].shape[0]))
        return out

    lm.model.generate = spy
    hook = lm.model.register_forward_hook(lambda *a: forwards.append(1))
    results = simple_evaluate(model=lm, tasks=["mars_tiny"], task_manager=TaskManager(include_path=str(_task_dir(tmp_path))),
                              gen_kwargs="mars=True,mars_threshold=0.0", log_samples=True)
    hook.remove()

    assert "exact_match,none" in results["results"]["mars_tiny"]
    assert len(results["samples"]["mars_tiny"]) == len(ROWS)
    assert seen and all(m is True and t == 0.0 for m, t, _, _ in seen)  # gen_kwargs reached the MARS generate
    steps = sum(new for _, _, new, _ in seen)  # generated positions per batch (rows decode in lockstep)
    assert len(forwards) < steps, (len(forwards), seen)  # several tokens per forward: MARS decoding was used


def _until_task(tmp_path, until):
    """The same local task, with a stop sequence that occurs inside the generations (lm-eval's sticky criterion)."""
    task_dir = _task_dir(tmp_path)
    yaml = (task_dir / "mars_tiny.yaml").read_text().replace('until: ["\\n\\n"]', f"until: {json.dumps(until)}")
    (task_dir / "mars_tiny.yaml").write_text(yaml.replace("max_gen_toks: 24", "max_gen_toks: 32"))
    return task_dir


@pytest.mark.parametrize("arch,until", [("qwen2", ["e", "o"]), ("gpt2-aligned", ["X"])])
def test_lm_eval_responses_identical_plain_tau1_verify(tmp_path, monkeypatch, arch, until):
    """lm-eval scores the same task with plain generate, MARS tau = 1 and MARS verify: identical responses."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from hf_mars import enable_mars

    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "datasets")
    tok = build_char_tokenizer()
    if arch == "qwen2":
        model = tiny_qwen2(tok, seed=1, initializer_range=0.5)
        add_mask_token(model, tok)
        enable_mars(model)
    else:
        from test_stateful_clients import position_only_model

        model = position_only_model(tok)
    lm = HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=4)
    manager = TaskManager(include_path=str(_until_task(tmp_path, until)))
    forwards = []
    hook = model.register_forward_hook(lambda *a: forwards.append(1))
    responses = {}
    for name, gen_kwargs in [("plain", None), ("tau1", "mars=True,mars_threshold=1.0"),
                             ("verify", "mars=True,mars_verify=True,mars_threshold=0.0"),
                             ("verify_last", "mars=True,mars_verify=True,mars_threshold=0.0,mars_use_last_mask=True")]:
        start = len(forwards)
        results = simple_evaluate(model=lm, tasks=["mars_tiny"], task_manager=manager, gen_kwargs=gen_kwargs,
                                  log_samples=True)
        samples = sorted(results["samples"]["mars_tiny"], key=lambda s: s["doc_id"])
        responses[name] = ([s["resps"] for s in samples], len(forwards) - start)
    hook.remove()
    assert responses["tau1"][0] == responses["plain"][0]
    assert responses["verify"][0] == responses["plain"][0]
    assert responses["verify_last"][0] == responses["plain"][0]
    assert any(len(r[0]) < 30 for r in responses["plain"][0])  # the stop sequence cut some generations short
    if arch == "gpt2-aligned":  # drafts are mostly right there: verify took fewer forwards than plain
        assert responses["verify"][1] < responses["plain"][1]
