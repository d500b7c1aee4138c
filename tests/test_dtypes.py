"""Every dtype argument of the Python API takes a name or a dtype object (jodc.dtypes.dtype_name), and refuses
anything else naming the allowed values."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jodc.dtypes import FLOAT_DTYPES, as_dtype, dtype_name
from jodc.models import DecoderConfig
from jodc.ops.heap import dtype_name as master_dtype_name


@pytest.mark.parametrize("spelling, name", [
    ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    (jnp.float32, "float32"), (jnp.bfloat16, "bfloat16"), (jnp.float16, "float16"),
    (np.float32, "float32"), (np.dtype("float16"), "float16"), (jnp.dtype("bfloat16"), "bfloat16"),
    (ml_dtypes.bfloat16, "bfloat16"),
])
def test_names_and_dtype_objects_normalise_to_the_name(spelling, name):
    assert dtype_name(spelling) == name
    assert as_dtype(spelling) == jnp.dtype(name)


@pytest.mark.parametrize("bad, shown", [
    ("int8", "'int8'"), (jnp.int32, "int32"), (None, "None"), (float, "float64"), ("nonsense", "'nonsense'"),
    (True, "True"), (np.float64, "float64"),
])
def test_anything_else_is_refused_naming_the_allowed_values(bad, shown):
    with pytest.raises(ValueError, match=rf"^the dtype must be one of \('float32', 'bfloat16', 'float16'\), "
                                         rf"got {shown} \(pass a name or a dtype such as jnp.float32\)$"):
        dtype_name(bad, FLOAT_DTYPES, "the dtype")


def test_decoder_config_and_bucket_dtypes_take_objects():
    config = DecoderConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                           num_kv_heads=1, param_dtype=jnp.bfloat16, compute_dtype=np.dtype("float32"))
    assert (config.param_dtype, config.compute_dtype) == ("bfloat16", "float32")
    assert config.params_dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"DecoderConfig.compute_dtype must be one of .*got int8"):
        DecoderConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      compute_dtype=jnp.int8)
    assert master_dtype_name(jnp.bfloat16) == master_dtype_name(ml_dtypes.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="master dtype must be float32 or bfloat16, got float16"):
        master_dtype_name(jnp.float16)
