"""The tiny RL sampler shared by tests/test_rl_dp_sampling.py (one process, 1 / 2 / 4 devices) and
tests/multiprocess/rl_sampling_case.py (2 processes x 1 or 2 devices), so both sides sample the same step with the
same model, task, keys and reward."""
import jax
import numpy as np

from jodc.models import DecoderConfig, init_params
from jodc.models.tokenizer import byte_level_tokenizer
from jodc.train.rl.config import RolloutConfig
from jodc.train.rl.layout import RolloutLayout
from jodc.train.rl.rollout import sampling_params
from jodc.train.rl.sampler import RolloutSampler
from jodc.train.rl.tasks import ArithmeticTask

TOKENIZER = byte_level_tokenizer()
CONFIG = DecoderConfig(vocab_size=264, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, eos_token_ids=(TOKENIZER.eos_token_id,), attention_block_size=8)
PROMPTS, GROUP, NEW = 4, 3, 4  # over 1, 2, 4 devices: batches of 12, 6 and 3 rows


def make_params():
    """The model's host fp32 parameters (the same in every process)."""
    return jax.tree.map(np.asarray, init_params(CONFIG, jax.random.PRNGKey(0)))


class CountingReward:
    """A deterministic reward that varies within groups and records every call (prompt, response)."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompt: str, response: str) -> float:
        self.calls.append((prompt, response))
        return float(sum(map(ord, prompt + response)) % 3 == 0)


def make_sampler(devices: int, reward, top_k: int = 4, layout: RolloutLayout | None = None) -> RolloutSampler:
    """The sampler of `PROMPTS` arithmetic prompts x `GROUP` responses over the first `devices` CPU devices (of
    this process's share of them under `layout`: default one process)."""
    rollout = RolloutConfig(prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=NEW, prompt_bucket=8)
    sampling = sampling_params(TOKENIZER, CONFIG, max_new_tokens=NEW, temperature=1.0, top_k=top_k, prompt_bucket=8)
    return RolloutSampler(task=ArithmeticTask(max_terms=4, max_digits=3), seed=7, pool=None, rollout=rollout,
                          model_config=CONFIG, tokenizer=TOKENIZER, sampling=sampling, reward_fn=reward,
                          devices=devices, layout=layout or RolloutLayout())
