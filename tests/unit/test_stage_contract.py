"""Every stage class answers the whole ``Stage`` protocol (Note "the contract" in
``stages/protocol.py``): stages 0-2, stage 3 and the tensor-parallel wrapper define each
member, with the protocol's parameters, so the engine calls them without probing."""
import inspect

import pytest

from zerotrain.stages.base import BucketedStage
from zerotrain.stages.protocol import Stage
from zerotrain.stages.zero12 import ShardedDataParallel
from zerotrain.stages.zero3.stage import PartitionedDataParallel
from zerotrain.tp.stage import TensorParallelStage

STAGE_CLASSES = [ShardedDataParallel, PartitionedDataParallel, TensorParallelStage]


def protocol_members(protocol: type) -> dict[str, object]:
    """The protocol's members: methods and properties by their object, attributes by
    their annotation."""
    members: dict[str, object] = {}
    for name, value in vars(protocol).items():
        if not name.startswith("_") and (inspect.isfunction(value)
                                         or isinstance(value, property)):
            members[name] = value
    for name, annotation in vars(protocol).get("__annotations__", {}).items():
        members.setdefault(name, annotation)
    return members


def declared(cls: type, name: str) -> bool:
    """``name`` is defined on ``cls`` (a method, property or class attribute) or declared
    as an instance attribute it sets (an annotation in its class or a base)."""
    if any(name in vars(k) for k in cls.__mro__ if k is not object):
        return True
    return any(name in vars(k).get("__annotations__", {}) for k in cls.__mro__)


def missing_members(cls: type, protocol: type = Stage) -> list[str]:
    """Members of ``protocol`` that ``cls`` lacks, or defines with other parameters."""
    problems = []
    for name, member in protocol_members(protocol).items():
        if not declared(cls, name):
            problems.append(f"{name}: missing")
            continue
        ours = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(member) and inspect.isfunction(ours):
            want = [(p.name, p.kind) for p in inspect.signature(member).parameters.values()]
            got = [(p.name, p.kind) for p in inspect.signature(ours).parameters.values()]
            if want != got:
                problems.append(f"{name}: parameters {got}, the protocol's {want}")
        elif inspect.isfunction(member) and isinstance(ours, property):
            problems.append(f"{name}: a property, the protocol's is a method")
        elif isinstance(member, property) and inspect.isfunction(ours):
            problems.append(f"{name}: a method, the protocol's is a property")
    return problems


@pytest.mark.parametrize("cls", STAGE_CLASSES, ids=lambda c: c.__name__)
def test_every_stage_class_defines_every_member_of_the_protocol(cls):
    assert missing_members(cls) == []


def test_the_tensor_parallel_wrapper_forwards_nothing_implicitly():
    assert "__getattr__" not in vars(TensorParallelStage)


def test_the_check_sees_a_missing_member_and_a_changed_signature():
    class Partial(BucketedStage):
        def settle(self, before_step: bool = False) -> None:   # keyword-only in the protocol
            pass

    problems = missing_members(Partial)
    assert "settle: parameters" in " ".join(problems)
    assert "shard_records: missing" in problems   # each subclass implements it
    assert "tensors_by_category: missing" in problems
