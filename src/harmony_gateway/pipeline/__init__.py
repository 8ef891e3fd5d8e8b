"""The shared stages every surface runs on, in the order a request meets them.

prepare: `prepare` (the Harmony prepare tail: prefix, render, stop ids, constraints, budgets),
`raw_prompt` (prompts and token ids as they are), `tokenizer`/`tokenizer_cache` and `output_spec` (other
models); select: `select_worker`; build: `build_request`; dispatch: `dispatch` (and `batch` for several
prompts); parse: `parse_output` (Harmony tokens), `text_output` and `output_parsers` (text), `detokenize`;
the loop over them: `drive`. Beside them: the request's `context`, the reasoning `reasoning_budget` and
`reasoning_store`, `hosted_tools`, `stream_interval` and `offload` (CPU work off the event loop).
"""
