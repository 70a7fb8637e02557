"""torch DCP folders read without a process group: ``.metadata`` through the restricted
unpickler (planted payloads run nothing, named errors) and chunk files checked."""
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.dcp import DcpCheckpoint
from zerotrain.checkpoint.dcp.metadata import read_metadata


class _Payload:
    """Unpickling this runs ``os.system(command)``: what a malicious checkpoint carries."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _write_dcp(path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    osd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    state = {"model": model.state_dict(),
             "optimizer": {"state": {names[i]: s for i, s in osd["state"].items()},
                           "param_groups": [{**g, "params": names} for g in osd["param_groups"]]}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return model, opt


def test_a_dcp_folder_reads_as_weights_moments_and_hyperparameters(tmp_path):
    model, opt = _write_dcp(str(tmp_path))
    ckpt = DcpCheckpoint(str(tmp_path), _model())
    assert ckpt.trainable_names() == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert torch.equal(ckpt.full("0.weight", "master"), model[0].weight.detach())
    first = opt.state[model[0].weight]
    assert torch.equal(ckpt.full("0.weight", "exp_avg"), first["exp_avg"])
    assert ckpt.state_keys("0.weight") == (["exp_avg", "exp_avg_sq"], 1.0)
    assert ckpt.hyperparameters()[0]["lr"] == 1e-2 and ckpt.counters() == {"global_steps": 1}


@pytest.mark.parametrize("where", ["metadata", "nested"])
def test_a_planted_payload_in_metadata_never_runs(tmp_path, where):
    _write_dcp(str(tmp_path))
    marker = tmp_path / "pwned"
    path = os.path.join(str(tmp_path), ".metadata")
    payload = _Payload(f"touch {marker}")
    if where == "nested":   # inside a real Metadata record, as a storage entry
        with open(path, "rb") as f:
            meta = pickle.load(f)
        key = next(iter(meta.storage_data))
        meta.storage_data[key] = payload
        payload = meta
    with open(path, "wb") as f:
        pickle.dump(payload, f)
    with pytest.raises(CheckpointError, match=r"refusing to read .*\.metadata.*system"):
        read_metadata(str(tmp_path))
    assert not marker.exists()


def test_a_chunk_file_outside_the_folder_is_refused(tmp_path):
    _write_dcp(str(tmp_path))
    path = os.path.join(str(tmp_path), ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)
    key = next(iter(meta.storage_data))
    meta.storage_data[key].relative_path = "../../etc/passwd"
    with open(path, "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(CheckpointError, match=r"'\.\./\.\./etc/passwd', which is not a file "
                                              "name inside the checkpoint directory"):
        read_metadata(str(tmp_path))


def test_a_truncated_chunk_file_is_named(tmp_path):
    _write_dcp(str(tmp_path))
    for name in os.listdir(tmp_path):
        if name.endswith(".distcp"):
            with open(tmp_path / name, "r+b") as f:
                f.truncate(100)
    with pytest.raises(CheckpointError, match=r"\.distcp ends before '"):
        DcpCheckpoint(str(tmp_path), _model()).full("0.weight", "master")


def _edit_metadata(folder, edit) -> None:
    path = os.path.join(str(folder), ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    with open(path, "wb") as f:
        pickle.dump(meta, f)


def test_a_chunk_length_beyond_its_shape_is_refused_before_reading(tmp_path):
    """A chunk of a 7x5 float tensor holds 140 bytes and a record's headers: a declared
    length of megabytes (or gigabytes, read from what lies there) is refused unread."""
    _write_dcp(str(tmp_path))

    def edit(meta):
        index = next(i for i in meta.storage_data if i.fqn == "model.0.weight")
        meta.storage_data[index].length = 2 << 20   # more than 140 bytes and any headers
    _edit_metadata(tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"'model\.0\.weight'.* declares \d+ bytes for 35 "
                                              r"torch\.float32 elements"):
        DcpCheckpoint(str(tmp_path), _model()).full("0.weight", "master")


def test_a_declared_shape_its_chunks_do_not_cover_is_refused_before_allocating(tmp_path):
    """The shape in .metadata is only a claim: 2**45 elements for a 35-element chunk would
    be allocated (or fail deep in torch) before the chunks were checked."""
    _write_dcp(str(tmp_path))

    def edit(meta):
        meta.state_dict_metadata["model.0.weight"].size = torch.Size([7, 5 << 40])
    _edit_metadata(tmp_path, edit)
    ckpt = DcpCheckpoint(str(tmp_path), _model())
    with pytest.raises(CheckpointError, match=r"cover 35 of its \d+ elements .*refusing to "
                                              "allocate"):
        ckpt.full("0.weight", "master")


def test_chunks_sharing_bytes_of_a_file_are_refused(tmp_path):
    """Two chunks declared over the same bytes would let a small file fill a large tensor."""
    _write_dcp(str(tmp_path))

    def edit(meta):
        md = meta.state_dict_metadata["model.0.weight"]
        first = md.chunks[0]
        md.size = torch.Size([14, 5])
        md.chunks.append(type(first)(offsets=torch.Size([7, 0]), sizes=first.sizes))
        index = next(i for i in meta.storage_data if i.fqn == "model.0.weight")
        meta.storage_data[type(index)("model.0.weight", torch.Size([7, 0]))] = \
            meta.storage_data[index]
    _edit_metadata(tmp_path, edit)
    with pytest.raises(CheckpointError, match="share bytes"):
        DcpCheckpoint(str(tmp_path), _model()).full("0.weight", "master")
