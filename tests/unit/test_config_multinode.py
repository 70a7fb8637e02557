"""ZeRO++ and MiCS keys: accepted at stage 3 with sizes that divide the world, named errors
otherwise (the node-size checks need the topology and are in tests/dist/test_multinode.py)."""
import pytest

from zerotrain.config import load_config
from zerotrain.errors import ConfigError


def _zero(stage=3, **keys):
    return {"train_batch_size": 8, "zero_optimization": {"stage": stage, **keys}}


def test_zero_plus_plus_keys_load_at_stage3():
    zero = load_config(_zero(zero_hpz_partition_size=2, zero_quantized_weights=True,
                             zero_quantized_gradients=True,
                             zero_quantized_nontrainable_weights=True),
                       world_size=4).zero_optimization
    assert zero.zero_quantized_nontrainable_weights
    assert (zero.zero_hpz_partition_size, zero.zero_quantized_weights,
            zero.zero_quantized_gradients, zero.mics_shard_size) == (2, True, True, -1)
    assert load_config(_zero(mics_shard_size=2), world_size=4).zero_optimization \
        .mics_shard_size == 2


@pytest.mark.parametrize("key, value", [("zero_quantized_gradients", True),
                                        ("zero_quantized_weights", True),
                                        ("zero_quantized_nontrainable_weights", True),
                                        ("zero_hpz_partition_size", 2),
                                        ("mics_shard_size", 2)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_plus_plus_below_stage3_is_a_named_error(key, value, stage):
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}: applies to ZeRO stage 3"):
        load_config(_zero(stage=stage, **{key: value}), world_size=4)


@pytest.mark.parametrize("key", ["zero_hpz_partition_size", "mics_shard_size"])
def test_group_size_must_divide_the_world(key):
    with pytest.raises(ConfigError, match=f"{key}: 3 does not divide the world size 4"):
        load_config(_zero(**{key: 3}), world_size=4)


def test_bad_mics_sizes_and_combinations_are_named():
    with pytest.raises(ConfigError, match="mics_shard_size: must be a positive"):
        load_config(_zero(mics_shard_size=0), world_size=4)
    with pytest.raises(ConfigError, match="mics_shard_size"):
        load_config(_zero(mics_shard_size=-2), world_size=4)
    with pytest.raises(ConfigError, match="zero_quantized_gradients: quantized gradients"):
        load_config(_zero(mics_shard_size=2, zero_quantized_gradients=True), world_size=4)
    with pytest.raises(ConfigError, match="hpZ and MiCS"):
        load_config(_zero(zero_hpz_partition_size=2, mics_shard_size=2), world_size=4)
    with pytest.raises(ConfigError, match="zero_hpz_partition_size"):
        load_config(_zero(zero_hpz_partition_size=0), world_size=4)
