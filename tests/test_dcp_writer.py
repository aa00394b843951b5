"""DCP data files written without running ``torch.save`` per item (``formats/dcp/writer.py``).

Each item must be, byte for byte, the archive ``torch.save`` writes with its CRC-32 fields off: for every dtype
and layout a state can hold, for a second tensor of a signature already seen (the cached prefix and suffix), and
for the cases written by ``torch.save`` itself (empty, non-compact, with attributes). A whole DCP save, on one
writer thread and on two, holds exactly those archives at the offsets its ``.metadata`` records (no CRC computed
on any thread: torch keeps that setting per thread), and plain DCP reads it back.
"""

from __future__ import annotations

import io
import math
import pickle
from contextlib import contextmanager

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptio.formats.dcp import writer
from ckptio.formats.dcp.save import save


@contextmanager
def no_crc():
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def reference(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(writer._loaded(t), out)
    return out.getvalue()


def ours(t: torch.Tensor) -> bytes:
    loaded = writer._loaded(t)
    parts = writer._archive_parts(loaded)
    if parts is None:
        return writer._whole(loaded)
    return parts[0] + bytes(writer._bytes_of(loaded)) + parts[1]


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    with_attr = torch.randn(3, generator=g)
    with_attr.note = "kept"  # type: ignore[attr-defined]
    cases = {
        "float32": base,
        "bfloat16": base.to(torch.bfloat16),
        "float16": base.to(torch.float16),
        "float8_e4m3fn": base.to(torch.float8_e4m3fn),
        "int8": (base * 10).to(torch.int8),
        "int64": torch.arange(7),
        "bool": base > 0,
        "complex64": torch.complex(base, -base),
        "0-dim step counter": torch.tensor(12.0),
        "transposed (compact, not contiguous)": base.t(),
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last),
        "a view of a larger storage": base[2:4],
        "strided view": base[:, ::2],
        "empty": torch.empty(0, 4),
        "requires_grad": torch.randn(4, 4, generator=g, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.randn(5, generator=g)),
        "with an attribute": with_attr,
    }
    return cases


@pytest.mark.parametrize("name", list(_cases()))
def test_each_item_is_the_archive_torch_save_writes(name):
    t = _cases()[name]
    with no_crc():
        expected = reference(t)
        assert ours(t) == expected, f"{name}: first of its signature"
        other = writer._loaded(t).clone()
        if other.numel() and other.dtype != torch.bool:
            raw = torch.empty(0, dtype=torch.uint8).set_(other.untyped_storage())
            raw.copy_(torch.randint(0, 255, (raw.numel(),), dtype=torch.uint8))
        assert ours(other) == reference(other), f"{name}: another tensor of its signature (cached wrapper)"
        assert writer.archive_length(t) == len(expected)


def test_a_tensor_with_the_crc_on_is_written_by_torch_save_itself():
    t = torch.randn(9, 3)
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        assert writer._archive_parts(writer._loaded(t)) is None
        assert ours(t) == reference(t)
    finally:
        torch.serialization.set_crc32_options(before)


def _optimizer_state() -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    # weights (and their moments) over writer.HEAD_ITEM: written after the small items, split among the threads
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    return get_optimizer_state_dict(model, opt)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_dcp_save_holds_those_archives_on_every_thread_and_dcp_reads_it(tmp_path, threads):
    """... and the small items (pickled values, tensors of at most ``HEAD_ITEM`` bytes: AdamW's ``step``, the biases)
    lie at the head of the file, before every larger tensor, on one thread as on several."""
    import threading

    from ckptio import _faults

    state = _optimizer_state()
    writers: set[str] = set()
    _faults.set_hook(lambda point: writers.add(threading.current_thread().name) if point == "dcp.item_written" else None)
    try:
        save(state, tmp_path, thread_count=threads)
    finally:
        _faults.set_hook(None)
    assert len(writers) == threads, writers
    data = (tmp_path / "__0_0.distcp").read_bytes()
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    spans = sorted((info.offset, info.length, index.fqn) for index, info in md.storage_data.items())
    assert spans[0][0] == 0 and sum(length for _, length, _ in spans) == len(data), "items tile the file"
    sizes = {index.fqn: math.prod(m.size) * m.properties.dtype.itemsize
             for index in md.storage_data for m in [md.state_dict_metadata[index.fqn]] if hasattr(m, "size")}
    large = [offset for offset, _, fqn in spans if sizes.get(fqn, 0) > writer.HEAD_ITEM]
    small = [offset for offset, _, fqn in spans if sizes.get(fqn, 0) <= writer.HEAD_ITEM]
    assert large and small and max(small) < min(large), "a small item lies among the large tensors"
    tensors = {f"state.{p}.{k}": v for p, st in state["state"].items() for k, v in st.items()}
    with no_crc():
        for offset, length, fqn in spans:
            if fqn in tensors:  # every tensor: exactly torch.save's archive without CRCs, whichever thread wrote it
                assert data[offset:offset + length] == reference(tensors[fqn]), fqn
    loaded = {"state": {p: {k: torch.zeros_like(v) for k, v in st.items()} for p, st in state["state"].items()},
              "param_groups": state["param_groups"]}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    for p, st in state["state"].items():
        for k, v in st.items():
            assert torch.equal(loaded["state"][p][k], v), (p, k)


def _saves_of_changing_states_in_one_process(tmp: str) -> dict:
    """On each rank: DCP saves of sharded states under the same folder name, one after the other in one process
    (what the plan cache sees in a training run), some of them of another shape; each read back by plain DCP."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.planner import SavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptio.storage import LocalFolderWriter

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def full(rows: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"w": torch.randn(rows, 4, generator=g), "b": torch.randn(rows, generator=g), "step": torch.tensor(seed * 1.0)}

    wrong = []
    for i, (rows, seed) in enumerate([(8, 1), (8, 2), (12, 3), (8, 4), (8, 4)]):
        whole = full(rows, seed)
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() else v for k, v in whole.items()}
        save(sharded, LocalFolderWriter.in_place(f"{tmp}/{i}"), "optim")
        dist.barrier()
        into = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) if v.dim() else torch.zeros_like(v)
                for k, v in whole.items()}
        dcp.load(into, checkpoint_id=f"{tmp}/{i}/optim")
        for k, v in whole.items():
            got = into[k].full_tensor() if hasattr(into[k], "full_tensor") else into[k]
            if not torch.equal(got, v):
                wrong.append(f"save {i}: {k}")
    cached = [k for k in SavePlanner._cached_all_plans if k.startswith("ckptio:optim:")]
    return {"wrong": wrong, "cached": len(cached)}


def test_plans_cached_between_saves_on_two_ranks_follow_every_change_of_the_state(tmp_path):
    from distributed import run_ranks

    out = run_ranks(2, _saves_of_changing_states_in_one_process, tmp=str(tmp_path))
    assert out[0]["wrong"] == [] and out[1]["wrong"] == [], out
    assert out[0]["cached"] == 1, "the coordinator kept the plans of the optimizer folder (the cache was in use)"


def _values(tmp, state: dict, sub: str) -> dict[str, bytes]:
    """fqn -> the bytes of each pickled value (DCP's ``BYTE_IO`` items) of a one-rank DCP save of ``state``."""
    save(state, tmp / sub)
    data = (tmp / sub / "__0_0.distcp").read_bytes()
    md = pickle.loads((tmp / sub / ".metadata").read_bytes())
    return {index.fqn: data[info.offset:info.offset + info.length] for index, info in md.storage_data.items()
            if not isinstance(state.get(index.fqn), torch.Tensor)}


def test_a_plain_value_already_pickled_is_written_from_its_bytes_and_they_are_torch_saves(tmp_path, monkeypatch):
    """DCP pickles each non-tensor value (an optimizer's hyper-parameters, flattened: one per parameter) with
    ``torch.save``, ~60 us each, at every save. An int, float, bool, str, None or a tuple/list of them already
    written is written again from the bytes kept (keyed by its exact pickle: 0.0 and -0.0, 1 and True, a tuple
    and a list stay apart); the bytes are exactly ``torch.save``'s."""
    first = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "name": "adamw", "none": None,
             "w": torch.arange(4.0)}
    equal = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "name": "adamw", "none": None,
             "w": torch.arange(4.0)}
    look_alike = {"lr": -0.0, "betas": [0.9, 0.999], "eps": 1, "amsgrad": 0, "name": "adamw ", "none": (None,),
                  "w": torch.arange(4.0)}
    look_alike_2 = {"lr": 0.0, "betas": (0.9, 0.999, 0.0), "eps": True, "amsgrad": 0.0, "name": "adamw",
                    "none": [None], "w": torch.arange(4.0)}
    _values(tmp_path, first, "warm")
    calls = []
    real_save = torch.save

    def counted(obj, f, *args, **kwargs):
        calls.append(obj)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counted)
    got = _values(tmp_path, equal, "again")
    assert not [c for c in calls if not isinstance(c, torch.Tensor)], "equal plain values were pickled again"
    long_text = {"note": "x" * 5000, "w": torch.arange(4.0)}  # a large value is never kept: pickled at each save
    _values(tmp_path, long_text, "long1")
    calls.clear()
    got = _values(tmp_path, long_text, "long2")
    assert [c for c in calls if isinstance(c, str)] == [long_text["note"]]
    with no_crc():
        out = io.BytesIO()
        real_save(long_text["note"], out)
        assert got["note"] == out.getvalue()
    for state, sub in ((look_alike, "a"), (look_alike_2, "b"), (equal, "c")):
        got = _values(tmp_path, state, sub)
        with no_crc():
            for fqn, data in got.items():
                out = io.BytesIO()
                real_save(state[fqn], out)
                assert data == out.getvalue(), (sub, fqn, state[fqn])
