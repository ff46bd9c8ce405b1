"""`hf-mars bench` and the measuring it shares with `hf-mars demo`.

- `measure`: `benchmark_generation`, MARS decoding against plain ``generate`` on any checkpoint, one process;
  `specs` the configurations it times, `figures` each row's speed-up, limit and efficiency, `table` the printed
  table, `command` the flags;
- `prompts`: prompt files normalised to records (with answers, accuracy is reported), tokenised and batched;
- `tasks`: the bundled, exactly checkable instruction tasks (the default prompt set; the demo trains on them);
- `timing`: the one timing harness (forward counts and times, step costs, interleaved timing, the machine);
- `kernels`: `to_onednn`, a model's linear layers on oneDNN's kernels for CPU decoding (`--kernels onednn`);
- `report`: `BenchmarkReport`, the demo's and the bench's JSON read as one typed report, and the model card's table.

Names load lazily, so that reading a report (`hf_mars.model_card`) does not import the benchmark.
"""

from hf_mars._moved import lazy_exports

_EXPORTS = {
    "benchmark_generation": "measure",
    "resolve_block_size": "measure",
    "PEERS": "specs",
    "PLAIN_MODES": "specs",
    "PROMPT_LOOKUP_TOKENS": "specs",
    "RunSpec": "specs",
    "build_specs": "specs",
    "COLUMNS": "table",
    "format_table": "table",
    "encode_prompts": "prompts",
    "load_prompts": "prompts",
    "make_batches": "prompts",
    "score_record": "prompts",
    "to_record": "prompts",
    "ForwardRecorder": "timing",
    "count_emitted": "timing",
    "machine_info": "timing",
    "measure_step_cost": "timing",
    "measure_step_costs": "timing",
    "time_interleaved": "timing",
    "to_onednn": "kernels",
    "BenchmarkReport": "report",
    "Measurement": "report",
    "add_arguments": "command",
    "run": "command",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
