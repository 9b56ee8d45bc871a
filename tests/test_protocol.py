import pickle

import numpy as np
import pytest
import ray
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from hybrid_rl.protocol import Batch, BatchMeta, Sampling

META = BatchMeta(step=3, temperature=0.7, sampling=Sampling.VALIDATE)


def make_batch(n: int = 4) -> Batch:
    """Rows are identifiable: ids[i] == i, tokens[i] is a ragged list of length i + 1."""
    return Batch(
        tensors={
            "ids": torch.arange(n),
            "x": torch.arange(n * 3, dtype=torch.float32).view(n, 3),
        },
        non_tensors={
            "tokens": [list(range(i + 1)) for i in range(n)],
            "info": [{"row": i, "tags": ["a"] * i} for i in range(n)],
        },
        meta=META,
    )


def rows(batch: Batch) -> list[int]:
    return batch["ids"].tolist()


def assert_rows(batch: Batch, expected: list[int]) -> None:
    """Every tensor and non-tensor of `batch` matches `make_batch` rows `expected`."""
    full = make_batch(max(expected, default=0) + 1)
    assert len(batch) == len(expected)
    assert rows(batch) == expected
    assert torch.equal(batch["x"], full["x"][expected])
    assert batch["tokens"].dtype == object and batch["tokens"].shape == (len(expected),)
    assert list(batch["tokens"]) == [list(range(i + 1)) for i in expected]
    assert list(batch["info"]) == [{"row": i, "tags": ["a"] * i} for i in expected]


# ----------------------------------------------------------------------------- construction


def test_construction_and_access():
    b = make_batch(3)
    assert len(b) == 3
    assert isinstance(b.tensors, TensorDict) and b.tensors.batch_size == torch.Size([3])
    assert b.keys() == ["ids", "x", "tokens", "info"]
    assert "x" in b and "tokens" in b and "temperature" not in b and "nope" not in b
    assert b.meta.temperature == 0.7 and Batch().meta == BatchMeta()
    assert_rows(b, [0, 1, 2])
    with pytest.raises(KeyError, match="'nope'.*available keys"):
        b["nope"]


def test_equal_length_lists_stay_one_element_per_row():
    b = Batch(non_tensors={"tokens": [[1, 2], [3, 4]], "d": [{"a": 1}, {"a": 2}]})
    assert b["tokens"].shape == (2,) and b["tokens"][0] == [1, 2]
    assert b["d"][1] == {"a": 2}
    assert len(b) == 2
    b2 = Batch(non_tensors={"arr": np.arange(6).reshape(3, 2)})
    assert b2["arr"].shape == (3,) and b2["arr"][2].tolist() == [4, 5]


def test_from_dict_and_tensordict_input():
    td = TensorDict({"a": torch.zeros(5, 2)}, batch_size=[5])
    b = Batch.from_dict(td, {"s": ["x"] * 5}, META)
    assert len(b) == 5 and b.tensors is td and b.meta == META
    # A TensorDict without a batch dim is re-batched along dim 0.
    assert len(Batch(TensorDict({"a": torch.zeros(4, 2)}, batch_size=[]))) == 4
    assert len(Batch()) == 0 and Batch().keys() == []


def test_length_mismatch_names_keys():
    with pytest.raises(ValueError, match=r"'b' has 4 rows but tensor 'a' has 3"):
        Batch({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"non-tensor 's' has 2 rows"):
        Batch({"a": torch.zeros(3)}, {"s": ["x", "y"]})
    with pytest.raises(ValueError, match="0-d"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="both"):
        Batch({"a": torch.zeros(2)}, {"a": [1, 2]})


def test_setitem():
    b = make_batch(3)
    b["y"] = torch.ones(3)
    b["names"] = ["a", "b", "c"]
    assert isinstance(b.tensors["y"], torch.Tensor)
    assert b.non_tensors["names"].dtype == object and list(b["names"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="'z' has 2 rows but the batch has 3"):
        b["z"] = torch.ones(2)
    with pytest.raises(ValueError, match="'z' has 4 rows"):
        b["z"] = [1, 2, 3, 4]
    with pytest.raises(TypeError, match="sequence"):
        b["z"] = "abc"
    # Re-assigning a key as the other kind moves it.
    b["y"] = [0, 1, 2]
    assert "y" in b.non_tensors and "y" not in b.tensors.keys()
    # A batch without keys takes the length of the first value.
    e = Batch(meta=META)
    e["t"] = torch.zeros(5)
    assert len(e) == 5


# ------------------------------------------------------------------------------- indexing


def test_int_and_slice_indexing():
    b = make_batch(5)
    assert_rows(b[1], [1])
    assert_rows(b[-1], [4])
    assert_rows(b[1:4], [1, 2, 3])
    assert_rows(b[::2], [0, 2, 4])
    with pytest.raises(IndexError):
        b[5]


def test_index_tensor_list_and_array():
    b = make_batch(5)
    assert_rows(b[torch.tensor([3, 0, 3])], [3, 0, 3])
    assert_rows(b[[4, 1]], [4, 1])
    assert_rows(b[np.array([2, 2])], [2, 2])
    assert_rows(b[[]], [])
    with pytest.raises(IndexError):
        b[torch.tensor([0.5])]


def test_bool_mask_indexing():
    b = make_batch(4)
    assert_rows(b[torch.tensor([True, False, True, False])], [0, 2])
    assert_rows(b[np.array([False, True, True, True])], [1, 2, 3])
    assert_rows(b[[False] * 4], [])
    with pytest.raises(IndexError, match="bool mask"):
        b[torch.tensor([True, False])]


def test_indexing_keeps_the_immutable_meta():
    b = make_batch(4)
    assert b[:2].meta is b.meta
    with pytest.raises(AttributeError):
        b.meta.step = 4


# ------------------------------------------------------------------------ key operations


def test_select():
    b = make_batch(3)
    s = b.select(keys=["x"], non_tensor_keys=["tokens"])
    assert s.keys() == ["x", "tokens"] and s.meta == META and len(s) == 3
    assert b.keys() == ["ids", "x", "tokens", "info"]  # select does not remove
    assert b.select().keys() == b.keys() and b.select().meta == b.meta  # None keeps all
    empty = b.select(keys=[], non_tensor_keys=[])
    assert empty.keys() == [] and empty.meta == META and len(empty) == 3
    with pytest.raises(KeyError, match=r"tensor key 'nope' not found.*\['ids', 'x'\]"):
        b.select(keys=["nope"])
    with pytest.raises(KeyError, match="non-tensor key 'nope'"):
        b.select(non_tensor_keys=["nope"])


def test_pop_removes():
    b = make_batch(3)
    p = b.pop(keys=["x"], non_tensor_keys=["info"])
    assert p.keys() == ["x", "info"] and p.meta == META and len(p) == 3
    assert b.keys() == ["ids", "tokens"] and b.meta == META
    assert "x" not in b.tensors.keys()
    assert b.pop().keys() == [] and b.keys() == ["ids", "tokens"]  # defaults pop nothing
    with pytest.raises(KeyError, match="'x'"):
        b.pop(keys=["x"])


def test_union():
    b = make_batch(3)
    other = Batch(
        {"ids": torch.arange(3), "adv": torch.ones(3)},
        {"tokens": [[0], [0, 1], [0, 1, 2]], "reward_info": [{"r": 1}] * 3},
        META,
    )
    assert b.union(other) is b
    assert b.keys() == ["ids", "x", "adv", "tokens", "info", "reward_info"]
    assert b.meta == META
    # A worker's result (default meta) leaves the meta as it was; a default meta takes the other's.
    assert b.union(Batch({"v": torch.ones(3)})).meta == META
    assert Batch({"ids": torch.arange(3)}).union(make_batch(3)).meta == META
    nested = TensorDict({"a": torch.ones(3, 2)}, batch_size=[3])
    b["nested"] = nested
    b.union(Batch({"nested": nested.clone()}))
    with pytest.raises(ValueError, match="'nested'"):
        b.union(Batch({"nested": nested * 2}))
    # Keyless batches adopt the other's length.
    assert len(Batch(meta=META).union(make_batch(2))) == 2


@pytest.mark.parametrize(
    "other, match",
    [
        (Batch({"ids": torch.tensor([0, 1, 9])}), "tensor 'ids'"),
        (Batch(non_tensors={"tokens": [[0], [0, 1], [9]]}), "non-tensor 'tokens'"),
        (Batch(meta=BatchMeta(temperature=0.5)), "meta differs"),
        (Batch({"y": torch.zeros(2)}), "length 3 and 2"),
    ],
)
def test_union_conflict_raises_and_leaves_self_unchanged(other, match):
    b = make_batch(3)
    with pytest.raises(ValueError, match=match):
        b.union(other)
    assert b.keys() == make_batch(3).keys() and b.meta == make_batch(3).meta


# ------------------------------------------------------------------------ row operations


def test_repeat_interleave_vs_tile():
    b = make_batch(3)
    assert_rows(b.repeat(2), [0, 0, 1, 1, 2, 2])
    assert_rows(b.repeat(2, interleave=True), [0, 0, 1, 1, 2, 2])
    assert_rows(b.repeat(2, interleave=False), [0, 1, 2, 0, 1, 2])
    assert_rows(b.repeat(1), [0, 1, 2])
    assert b.repeat(3).meta == b.meta
    with pytest.raises(ValueError):
        b.repeat(0)


def test_chunk_and_split():
    b = make_batch(6)
    parts = b.chunk(3)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert_rows(parts[2], [4, 5])
    with pytest.raises(ValueError, match=r"pad_to_divisor\(4\)"):
        b.chunk(4)
    assert [rows(p) for p in b.split(4)] == [[0, 1, 2, 3], [4, 5]]
    assert [rows(p) for p in b.split(6)] == [[0, 1, 2, 3, 4, 5]]
    assert_rows(b.split(4)[1], [4, 5])


def test_concat_round_trips_chunk():
    b = make_batch(6)
    again = Batch.concat(b.chunk(3))
    assert_rows(again, list(range(6)))
    assert again.meta == b.meta


def test_concat_ragged_non_tensors_and_errors():
    a = Batch(non_tensors={"t": [[1, 2], [3, 4]]})  # same-length lists: must not become 2-D
    c = Batch(non_tensors={"t": [[5]]})
    cat = Batch.concat([a, c])
    assert cat["t"].shape == (3,) and list(cat["t"]) == [[1, 2], [3, 4], [5]]
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
    with pytest.raises(ValueError, match="tensor keys"):
        Batch.concat([make_batch(2), make_batch(2).select(keys=["x"])])
    d = make_batch(2)
    d.meta = BatchMeta(temperature=0.1)
    with pytest.raises(ValueError, match="batch 1 has meta"):
        Batch.concat([make_batch(2), d])


def test_pad_to_divisor():
    b = make_batch(3)
    padded, pad = b.pad_to_divisor(2)
    assert pad == 1
    assert_rows(padded, [0, 1, 2, 0])
    padded, pad = b.pad_to_divisor(7)
    assert pad == 4
    assert_rows(padded, [0, 1, 2, 0, 1, 2, 0])
    same, pad = b.pad_to_divisor(3)
    assert same is b and pad == 0
    assert b.pad_to_divisor(1) == (b, 0)


def test_pad_unpad_round_trip():
    b = make_batch(5)
    padded, pad = b.pad_to_divisor(4)
    assert len(padded) == 8
    assert_rows(padded.unpad(pad), [0, 1, 2, 3, 4])
    assert b.unpad(0) is b
    assert_rows(b.unpad(5), [])
    with pytest.raises(ValueError):
        b.unpad(6)


def test_to_and_repr():
    b = make_batch(2)
    moved = b.to("cpu")
    assert moved.tensors.device == torch.device("cpu")
    assert_rows(moved, [0, 1]) and moved.meta == b.meta
    r = repr(b)
    assert r.startswith("Batch(len=2") and "x: (2, 3) float32" in r and "tokens" in r
    assert "temperature" in r


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20), k=st.integers(1, 8))
def test_property_pad_chunk_concat_unpad(n, k):
    b = make_batch(n)
    padded, pad = b.pad_to_divisor(k)
    assert len(padded) % k == 0 and 0 <= pad < k
    chunks = padded.chunk(k)
    assert all(len(c) == len(padded) // k for c in chunks)
    assert_rows(Batch.concat(chunks).unpad(pad), list(range(n)))


# ----------------------------------------------------------------------------- transport


def test_pickle_round_trip():
    b = make_batch(3)
    out = pickle.loads(pickle.dumps(b))
    assert_rows(out, [0, 1, 2])
    assert out.meta == b.meta


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_round_trip(local_ray):
    # One actor only: every extra Ray worker process costs seconds of torch import.

    @ray.remote(num_cpus=0)
    class Worker:
        def add_adv(self, batch: Batch) -> Batch:
            batch["adv"] = batch["x"].sum(-1)
            return batch.repeat(2)

    b = make_batch(3)
    ref = ray.put(b)
    assert_rows(ray.get(ref), [0, 1, 2])
    worker = Worker.remote()
    for arg in (b, ref):  # passed by value and as an object-store reference
        out = ray.get(worker.add_adv.remote(arg))
        assert_rows(out, [0, 0, 1, 1, 2, 2])
        assert torch.equal(out["adv"], b["x"].sum(-1).repeat_interleave(2))
        assert out.meta == b.meta
    assert "adv" not in b  # the driver's batch was not mutated by the worker
