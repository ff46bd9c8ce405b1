"""A burst of the demo's 192 held-out questions against any OpenAI-compatible server (vLLM, hf-mars serve, ...):
requests/s, tokens/s and accuracy. Runs in an engine's own virtualenv: it needs only `openai`, and reads the
bundled tasks' question generator (hf_mars/bench/tasks.py) by file path (pure Python), not through `hf_mars`.

    python benchmarks/engines/burst.py --port 8123 --model /path/to/mars-checkpoint
"""

import argparse
import asyncio
import importlib.util
import json
import time
from pathlib import Path

from openai import AsyncOpenAI

_spec = importlib.util.spec_from_file_location("bundled_tasks", Path(__file__).parents[2] / "hf_mars/bench/tasks.py")
data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data)


async def main(args):
    examples = data.generate_examples(args.requests, seed=1, split="eval")
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key=args.api_key, max_retries=0,
                         timeout=600)

    async def one(example):
        r = await client.chat.completions.create(model=args.model, messages=[example["messages"][0]], temperature=0,
                                                 max_tokens=64, extra_body=json.loads(args.extra_body))
        return r.choices[0].message.content, r.usage.completion_tokens

    try:
        await one(examples[0])  # warm-up, not timed
        t = time.perf_counter()
        results = await asyncio.gather(*(one(e) for e in examples))
        seconds = time.perf_counter() - t
    finally:
        await client.close()
    acc = data.accuracy([e["task"] for e in examples], [text for text, _ in results],
                        [e["messages"][1]["content"] for e in examples])
    tokens = sum(n for _, n in results)
    print(json.dumps({"requests": len(examples), "seconds": round(seconds, 2),
                      "requests_per_s": round(len(examples) / seconds, 2), "completion_tokens": tokens,
                      "tokens_per_s": round(tokens / seconds, 1), "accuracy": acc["overall"]}))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True, help="The model name the server expects.")
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--api-key", default="none")
    p.add_argument("--extra-body", default="{}", help='extra request fields as JSON, e.g. \'{"bad_words": ["<|mask|>"]}\'')
    asyncio.run(main(p.parse_args()))
