"""Supervised fine-tuning: the examples (`data`, `embedded`), which of them form each minibatch (`sampler`), how a
plan becomes device arrays (`batching`), and the loop (`loop.run_sft`, also `jodc.train.run_sft`)."""
