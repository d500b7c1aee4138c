"""The policy losses' shared calling convention (PolicyInputs, PolicyLoss.apply) and the registry's metadata,
which the RL trainer reads instead of inspecting signatures."""
import inspect

import jax
import numpy as np
import pytest
from test_losses import _random_policy_batch

from jodc.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    PolicyInputs,
    decoupled_ppo_loss,
    dg_loss,
    dppo_loss,
    get_policy_loss,
    ppo_loss,
    topk_logprobs,
)


def test_apply_with_policy_inputs_equals_the_plain_call():
    logits, tokens, mu, adv, mask = _random_policy_batch(0)
    segments = np.where(mask > 0, 1, 0).astype(np.int32)
    plain = ppo_loss(logits, tokens, mu, adv, mask, clip_high=0.3, aggregation="seq-mean-token-mean",
                     segment_ids=segments, normalizer=5.0, temperature=0.7)
    keywords = ppo_loss(logits=logits, tokens=tokens, old_logprobs=mu, advantages=adv, mask=mask, clip_high=0.3,
                        aggregation="seq-mean-token-mean", segment_ids=segments, normalizer=5.0, temperature=0.7)
    inputs = PolicyInputs(tokens, mu, adv, mask, aggregation="seq-mean-token-mean", segment_ids=segments,
                          normalizer=5.0, temperature=0.7)
    applied = jax.jit(lambda x, i: ppo_loss.apply(x, i, clip_high=0.3))(logits, inputs)  # PolicyInputs is a pytree
    for other in (keywords, applied):
        np.testing.assert_allclose(other[0], plain[0], rtol=1e-6)
        assert other[1].keys() == plain[1].keys()


def test_registry_metadata_replaces_signature_inspection():
    assert get_policy_loss("dppo").anchor == "behaviour_logprobs"
    assert get_policy_loss("ppo").anchor == "old_logprobs"
    assert get_policy_loss("decoupled_ppo").anchor == "proximal_logprobs"
    assert get_policy_loss("dg").anchor is None and get_policy_loss("gpg").anchor is None
    assert get_policy_loss("decoupled_ppo").required_arrays() == ("proximal_logprobs", "behaviour_logprobs")
    assert get_policy_loss("tis").extras == ("rollout_logprobs",)
    assert get_policy_loss("dppo").required_arrays() == ("behaviour_logprobs",)
    assert get_policy_loss("dppo_topk").required_arrays() == ("behaviour_logprobs", "topk_ids", "topk_logprobs")
    assert get_policy_loss("dppo").required_arrays(approximation="topk")[1:] == ("topk_ids", "topk_logprobs")
    assert [n for n in ("dppo", "dg", "gpg", "ppo", "gspo", "tis", "decoupled_ppo", "geo_mean")
            if get_policy_loss(n).needs_trainer_logprobs] == ["ppo", "gspo", "tis", "decoupled_ppo", "geo_mean"]
    assert get_policy_loss("gspo").default_aggregation == "seq-mean-token-mean"
    assert get_policy_loss("dapo").default_aggregation == "token-mean"
    assert get_policy_loss("dapo").option_defaults["clip_high"] == 0.28
    assert get_policy_loss("tis_seq").option_defaults["level"] == "sequence"
    for name, loss in POLICY_LOSSES.items():
        assert loss.default_aggregation in AGGREGATIONS, name
        # the documented uniform positional convention: (logits, tokens, anchor, advantages, mask)
        assert list(inspect.signature(loss).parameters)[:5][3:] == ["advantages", "mask"], name


def test_signatures_show_each_loss_own_arguments():
    assert str(inspect.signature(dg_loss)).startswith("(logits, tokens, advantages, mask, *, eta")
    params = inspect.signature(decoupled_ppo_loss).parameters
    assert list(params)[:6] == ["logits", "tokens", "proximal_logprobs", "advantages", "mask", "behaviour_logprobs"]
    assert params["behaviour_logprobs"].default is inspect.Parameter.empty
    assert inspect.signature(get_policy_loss("sapo")).parameters["aggregation"].default == "seq-mean-token-mean"
    assert "DPPO policy loss" in dppo_loss.__doc__ and dppo_loss.__name__ == "dppo_loss"


def test_bad_calls_name_the_problem():
    logits, tokens, mu, adv, mask = _random_policy_batch(1)
    with pytest.raises(TypeError, match=r"ppo_loss: .*clip_hgh"):
        ppo_loss(logits, tokens, mu, adv, mask, clip_hgh=0.3)
    with pytest.raises(TypeError, match=r"ppo_loss: unexpected keyword argument\(s\) \['delta_low'\]"):
        ppo_loss.apply(logits, PolicyInputs(tokens, mu, adv, mask), delta_low=0.1)
    with pytest.raises(TypeError, match=r"missing the per-token array\(s\) \['behaviour_logprobs'\]"):
        decoupled_ppo_loss.apply(logits, PolicyInputs(tokens, mu, adv, mask))
    with pytest.raises(ValueError, match="old_logprobs is required"):
        ppo_loss.apply(logits, PolicyInputs(tokens, None, adv, mask))
    with pytest.raises(TypeError, match="presets .*'eta'.* are not options"):
        ppo_loss.preset(eta=1.0)
    ids, lps = topk_logprobs(logits, tokens, 3)
    topk = get_policy_loss("dppo_topk")
    np.testing.assert_allclose(topk(logits, tokens, mu, adv, mask, topk_ids=ids, topk_logprobs=lps)[0],
                               dppo_loss(logits, tokens, mu, adv, mask, approximation="topk", topk_ids=ids,
                                         topk_logprobs=lps)[0])
