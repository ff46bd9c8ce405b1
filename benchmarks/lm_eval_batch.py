"""Tokens per forward of MARS under lm-evaluation-harness, batch 1 against batch 8.

lm-eval stops generations with its own stop-sequence criterion, which keeps per-row state; this measures what
that costs MARS in a batch. A local `generate_until` task holds the demo's held-out questions (chat template
applied by the harness, stop sequences as a harness task declares them); the harness drives the library's
`generate` on the checkpoint (loaded here, so the installed `hf_mars` decodes, not the checkpoint's copy), and
`HF_MARS_STATS` records each call's tokens and forwards per row.

    python benchmarks/lm_eval_batch.py --model runs/demo/mars-checkpoint [--questions 48] [--threshold 0.95]

Prints, per batch size: tokens per forward (per row: emitted tokens / forwards the row took part in), the
harness's wall time, and whether the responses equal batch 1's.
"""

import argparse
import json
import os
import tempfile
import textwrap
import time
from pathlib import Path


def task_dir(root: Path, questions: int) -> Path:
    from hf_mars.demo.data import generate_examples

    rows = [{"question": ex["messages"][0]["content"], "answer": ex["messages"][1]["content"]}
            for ex in generate_examples(questions, seed=7, split="eval")]
    folder = root / "tasks"
    folder.mkdir()
    (folder / "mars_heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "mars_heldout.yaml").write_text(textwrap.dedent(f"""\
        task: mars_heldout
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "mars_heldout.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n\\n", "Question:"]
          max_gen_toks: 64
          do_sample: false
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        metadata:
          version: 1.0
        """))
    return folder


def run(model_dir: str, questions: int, threshold: float, batch_sizes, verify: bool):
    import transformers
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from hf_mars import enable_mars

    tmp = Path(tempfile.mkdtemp())
    os.environ["HF_DATASETS_CACHE"] = str(tmp / "datasets")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = enable_mars(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval())
    manager = TaskManager(include_path=str(task_dir(tmp, questions)))
    gen = f"mars=True,mars_threshold={threshold}" + (",mars_verify=True" if verify else "")
    rows, first = [], None
    for bs in batch_sizes:
        stats = tmp / f"stats-{bs}.jsonl"
        os.environ["HF_MARS_STATS"] = str(stats)
        lm = HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=bs)
        start = time.perf_counter()
        results = simple_evaluate(model=lm, tasks=["mars_heldout"], task_manager=manager, gen_kwargs=gen,
                                  log_samples=True, apply_chat_template=True)
        seconds = time.perf_counter() - start
        calls = [json.loads(line) for line in stats.read_text().splitlines()]
        tokens = sum(sum(c["emitted_tokens"]) for c in calls)
        forwards = sum(sum(c["forward_passes"]) for c in calls)
        samples = sorted(results["samples"]["mars_heldout"], key=lambda s: s["doc_id"])
        responses = [s["resps"] for s in samples]
        first = first or responses
        rows.append({"batch_size": bs, "tokens": tokens, "row_forwards": forwards,
                     "tokens_per_forward": round(tokens / max(forwards, 1), 3), "seconds": round(seconds, 2),
                     "same_responses_as_first": sum(a == b for a, b in zip(responses, first)),
                     "questions": len(responses)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--questions", type=int, default=48)
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--batch-sizes", default="1,8")
    args = p.parse_args()
    run(args.model, args.questions, args.threshold, [int(b) for b in args.batch_sizes.split(",")], args.verify)
