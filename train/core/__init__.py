"""What both trainers share: the config sections, the decoder and tokenizer a run uses, checkpoints, metrics,
timelines, JSONL reading, multi-process launch and the end-of-run bookkeeping."""
