"""ShardSpec: parsing, formatting, shapes and DTensor placements."""
import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.specs import ShardSpec, SpecError, all_specs

EVERY_SPEC = [s for ndim in range(4) for s in all_specs(ndim, 2, with_partial=True)]


def test_parse_list_and_compact_forms():
    expected = ShardSpec(((0,), (), (1,)))
    assert ShardSpec.parse("[S0, R, S1]") == expected
    assert ShardSpec.parse("S0RS1") == expected
    assert ShardSpec.parse(" [S0,R,S1] ") == expected
    assert ShardSpec.parse("S01R") == ShardSpec(((0, 1), ()))
    assert ShardSpec.parse("RS0+P1") == ShardSpec(((), (0,)), (1,))
    assert ShardSpec.parse("[R, R]+P01") == ShardSpec(((), ()), (0, 1))


def test_format():
    spec = ShardSpec(((0, 1), (), ()), ())
    assert str(spec) == "S01RR"
    assert spec.to_list_str() == "[S01, R, R]"
    assert str(ShardSpec(((), (0,)), (1,))) == "RS0+P1"
    assert ShardSpec(((), (0,)), (1,)).to_list_str() == "[R, S0]+P1"


@pytest.mark.parametrize("spec", EVERY_SPEC, ids=str)
def test_round_trip_both_forms(spec):
    assert ShardSpec.parse(str(spec)) == spec
    assert ShardSpec.parse(spec.to_list_str()) == spec


def test_all_specs_counts_and_uniqueness():
    # each of the 2 axes picks: unused, one of the dims, or (with_partial) partial
    assert len(set(all_specs(3, 2))) == 4 * 4
    assert len(set(all_specs(3, 2, with_partial=True))) == 5 * 5
    assert ShardSpec.parse("S01RR") in all_specs(3, 2)
    assert all(not s.partial for s in all_specs(2, 2))


@pytest.mark.parametrize("text", ["S2x", "X", "[S0, Q]", "[S0, R", "S0R+Q1", "S0R+P", "S0R+P1x", "S0 R"])
def test_invalid_strings_raise(text):
    with pytest.raises(SpecError):
        ShardSpec.parse(text)


@pytest.mark.parametrize("text", ["S0S0", "S0R+P0", "[S01, S1]", "RR+P00"])
def test_axis_used_twice_raises(text):
    with pytest.raises(SpecError, match="used twice"):
        ShardSpec.parse(text)


def test_descending_axes_on_a_dim_raise():
    with pytest.raises(SpecError, match="ascending"):
        ShardSpec.parse("S10R")


def test_local_shape():
    assert ShardSpec.parse("S0S1").local_shape((8, 12), (2, 4)) == (4, 3)
    assert ShardSpec.parse("S01R").local_shape((16, 3), (2, 4)) == (2, 3)
    assert ShardSpec.parse("RR+P01").local_shape((5, 7), (2, 4)) == (5, 7)
    assert ShardSpec.parse("S1R").local_numel((8, 3), (2, 4)) == 6


def test_divisibility_and_rank_errors():
    with pytest.raises(SpecError, match="dim 0 of size 6 cannot be sharded 4 ways.*divisible by 4"):
        ShardSpec.parse("S1R").local_shape((6, 4), (2, 4))
    with pytest.raises(SpecError, match="2 dims but the tensor has shape"):
        ShardSpec.parse("S0R").local_shape((8,), (2, 4))
    with pytest.raises(SpecError, match="uses mesh axis 1"):
        ShardSpec.parse("S1").check((8,), (2,))
    assert not ShardSpec.parse("S01").fits((4,), (2, 4))
    assert ShardSpec.parse("S01").fits((8,), (2, 4))
    assert not ShardSpec.parse("S0").fits((8, 8), (2, 4))


@pytest.mark.parametrize("spec", all_specs(3, 2, with_partial=True), ids=str)
def test_dtensor_placements_round_trip(spec):
    placements = spec.to_placements(2)
    assert len(placements) == 2
    assert ShardSpec.from_placements(placements, 3) == spec


def test_dtensor_placements_by_hand():
    assert ShardSpec.parse("S01R").to_placements(2) == (Shard(0), Shard(0))
    assert ShardSpec.parse("RS0+P1").to_placements(2) == (Shard(1), Partial())
    assert ShardSpec.parse("RR").to_placements(2) == (Replicate(), Replicate())
    assert ShardSpec.from_placements((Shard(-1), Replicate()), 2) == ShardSpec.parse("RS0")


def test_non_sum_partial_is_rejected():
    with pytest.raises(SpecError, match="sum-partial"):
        ShardSpec.from_placements((Partial("max"), Replicate()), 1)
