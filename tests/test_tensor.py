"""Tensor basics: constructors, views, device moves, and copy-on-write for in-place ops."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml import ops
from forge_ml.errors import ShapeError


def test_constructors_and_dtypes():
    assert fm.tensor([1.0, 2.0]).dtype == fm.float32
    assert fm.tensor([1, 2]).dtype == fm.int64
    assert fm.tensor(np.zeros(3, np.float64)).dtype == fm.float64
    assert fm.tensor(np.zeros(3, np.int32)).dtype == fm.int32
    big = fm.tensor(np.array([2**32 - 1], np.uint32))    # int32 cannot hold it: int64
    assert big.dtype == fm.int64 and big.numpy().tolist() == [2**32 - 1]
    assert fm.tensor(np.array([7], np.uint16)).dtype == fm.int32
    t = fm.zeros((2, 3), "float64")
    assert t.shape == (2, 3) and t.dtype == fm.float64 and str(t.device) == "cpu"
    assert fm.full((2,), 4.0).numpy().tolist() == [4.0, 4.0]


def test_integer_tensors_from_other_values():
    """NaN or inf cannot become an integer (torch refuses too), nor can a value past the
    integer type's range; floats are truncated, and the id checks see the values kept."""
    with pytest.raises(fm.DTypeError, match="NaN or inf"):
        fm.tensor([1.0, float("nan")], dtype="int64")
    with pytest.raises(fm.DTypeError, match="NaN or inf"):
        fm.tensor(np.array([np.inf]), dtype="int32")
    with pytest.raises(fm.DTypeError, match="do not fit int32"):   # it wrapped to id 5
        fm.tensor(np.array([2**32 + 5]), dtype="int32")
    ids = fm.tensor(np.array([7.9]), dtype="int32")          # truncated, as torch does
    assert ids.numpy().tolist() == [7]
    wte = fm.zeros((8, 2))
    assert ops.embedding(ids, wte, fm.zeros((4, 2))).shape == (1, 2)


def test_casts_to_an_integer_dtype_are_checked_as_tensor_is():
    """.to("int32") of NaN or 1e20 gave -2147483648 (a NumPy warning at most), and so did
    full(..., nan, "int32"); tensor(...) refused both. Now all three refuse."""
    with pytest.raises(fm.DTypeError, match="to: cannot store NaN or inf as int32"):
        fm.tensor([1.0, float("nan")]).to("int32")
    with pytest.raises(fm.DTypeError, match="do not fit int32"):
        fm.tensor([1e20]).to("int32")
    with pytest.raises(fm.DTypeError, match="NaN or inf"):
        fm.full((2,), float("nan"), "int32")
    assert fm.tensor([7.9, -3.5]).to("int32").numpy().tolist() == [7, -3]   # truncated
    assert fm.full((2,), 3, "int64").numpy().tolist() == [3, 3]


def test_integer_narrowing_and_assign_refuse_values_that_would_wrap():
    """int64 -> int32 wrapped silently (2**32 + 3 became 3, an embedding read row 3), and
    ops.assign stored the wrapped value while caching the range before the cast (the next
    embedding named an id the tensor did not hold)."""
    big = fm.tensor([[2**32 + 3]])
    with pytest.raises(fm.DTypeError, match="do not fit int32"):
        big.to("int32")
    big._storage.id_range = None          # no cached range: the values are read
    with pytest.raises(fm.DTypeError, match="do not fit int32"):
        big.to("int32")
    assert fm.tensor([[5, -7]]).to("int32").numpy().tolist() == [[5, -7]]
    buf = fm.zeros((1, 1), "int32")
    with pytest.raises(fm.DTypeError, match="assign: values 4294967297..4294967297 do not fit int32"):
        ops.assign(buf, [[2**32 + 1]])
    assert buf.numpy().tolist() == [[0]]           # nothing written
    ops.assign(buf, np.array([[6.0]]))
    assert buf._storage.id_range == (6, 6) and buf.numpy().tolist() == [[6]]


def test_numpy_scalars_and_foreign_arrays_keep_their_dtype():
    """tensor(np.float64(x)) and tensor(a float64 torch tensor) became float32, rounded; a
    torch tensor that requires grad raised torch's own RuntimeError."""
    torch = pytest.importorskip("torch")
    x = 0.1 + 1e-12
    for data in (np.float64(x), torch.tensor(x, dtype=torch.float64)):
        t = fm.tensor(data)
        assert t.dtype == fm.float64 and t.shape == () and t.item() == x
    assert fm.tensor(np.int32(7)).dtype == fm.int32
    assert fm.tensor(torch.ones(2, 3, dtype=torch.float64)).shape == (2, 3)
    assert fm.tensor(1.5).dtype == fm.float32 and fm.tensor(True).dtype == fm.int64
    with pytest.raises(fm.DTypeError, match="cannot read a Tensor as an array"):
        fm.tensor(torch.ones(2, requires_grad=True))
    # a 0-d big-endian array stays 0-d (copied to native order)
    assert fm.Tensor(np.array(2.0, ">f4"), fm.Device.parse("cpu")).shape == ()


def test_the_constructor_takes_any_numpy_layout_and_refuses_other_data():
    """Tensor(array, device) with a Fortran-ordered or big-endian array: the C kernels read the
    memory as C-ordered native floats and gave wrong values (up to 1e17) without an error."""
    dev = fm.Device.parse("cpu")
    a = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    want = ops.gelu(fm.tensor(a.T.copy())).numpy()
    np.testing.assert_array_equal(ops.gelu(fm.Tensor(a.T, dev)).numpy(), want)
    b = a.T.astype(">f4")
    np.testing.assert_array_equal(ops.gelu(fm.Tensor(b, dev)).numpy(), want)
    with pytest.raises(fm.DTypeError, match="takes a NumPy or CuPy array, got list"):
        fm.Tensor([1.0], dev)


def test_from_numpy_copies():
    a = np.arange(6, dtype=np.float32)
    t = fm.from_numpy(a)
    a[0] = 100.0
    assert t.numpy()[0] == 0.0
    h = t.numpy()
    h[1] = 50.0
    assert t.numpy()[1] == 1.0


def test_reshape_is_a_view_and_checks_sizes():
    t = fm.tensor(np.arange(12, dtype=np.float32))
    v = t.reshape(3, 4)
    assert v.shape == (3, 4) and np.shares_memory(v.data, t.data)
    assert t.reshape(-1, 6).shape == (2, 6)
    with pytest.raises(fm.ShapeError):
        t.reshape(5, 3)
    with pytest.raises(fm.ShapeError):
        t.reshape(-1, -1)


def test_kv_append_copy_on_write_protects_views():
    cache = fm.zeros((1, 2, 4, 3))
    before = cache.reshape(2, 12)            # a view taken before the write
    new = fm.tensor(np.ones((1, 2, 1, 3), np.float32))
    ops.kv_append(cache, new, 2)
    assert before.numpy().sum() == 0.0       # the view kept the old values
    assert cache.numpy()[0, :, 2].sum() == 6.0
    # with no other view alive the write is in place (no copy)
    buf = cache.data
    ops.kv_append(cache, new, 3)
    del before
    ops.kv_append(cache, new, 0)
    assert cache.numpy()[0, :, :, 0].sum() == 6.0
    assert cache.version == 3
    del buf


def test_scatter_add_rows_copy_on_write_protects_views():
    dst = fm.zeros((5, 2))
    alias = dst.reshape(10)
    ops.scatter_add_rows(dst, fm.tensor([1, 1, 4]), fm.tensor(np.ones((3, 2), np.float32)))
    assert alias.numpy().sum() == 0.0
    assert dst.numpy()[:, 0].tolist() == [0.0, 2.0, 0.0, 0.0, 1.0]


def test_in_place_write_without_views_does_not_copy():
    cache = fm.zeros((2, 4, 3))
    data_before = cache.data
    ops.kv_append(cache, fm.tensor(np.ones((2, 1, 3), np.float32)), 1)
    assert cache.data is data_before


def test_to_device_and_dtype():
    t = fm.tensor([1.5, 2.5])
    assert t.to("cpu") is t
    assert t.to("float64").dtype == fm.float64
    assert t.to(fm.float64).numpy().tolist() == [1.5, 2.5]
    with pytest.raises(fm.DeviceError):
        t.to("tpu")


def test_bfloat16_on_cpu_is_a_clear_error():
    with pytest.raises(fm.DTypeError):
        fm.zeros((2,), "bfloat16")


def test_cuda_without_gpu_is_a_device_error():
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy present: covered by tests/test_cuda.py")
    except Exception:
        pass
    with pytest.raises(fm.DeviceError) as e:
        fm.zeros((2,), device="cuda")
    assert "cuda" in str(e.value).lower()


def test_item_and_errors():
    assert fm.tensor([3.0]).item() == 3.0
    with pytest.raises(fm.ShapeError):
        fm.tensor([1.0, 2.0]).item()
    with pytest.raises(fm.DeviceError):
        fm.Device.parse("cuda:x")
    with pytest.raises(fm.DTypeError):
        fm.tensor(np.array(["a"]))


def test_id_range_cache_follows_writes():
    ids = fm.tensor(np.array([[3, 1], [2, 9]], np.int64))
    assert ids._storage.id_range == (1, 9)
    assert ids.reshape(4)._storage.id_range == (1, 9)     # views share it
    wte, wpe = fm.zeros((10, 2)), fm.zeros((4, 2))
    ops.embedding(ids, wte, wpe)
    # an in-place write clears the cache, so the next check looks at the data again
    dst = fm.tensor(np.array([[1], [2]], np.int64))
    dst._prepare_write()
    assert dst._storage.id_range is None
    dst.data[0, 0] = 50
    with pytest.raises(fm.ShapeError, match="token id 50"):
        ops.embedding(dst.reshape(2), fm.zeros((10, 2)), fm.zeros((4, 2)))


def test_id_range_cache_is_not_trusted_once_the_raw_array_is_handed_out():
    """A write through ``t.data`` went past the cached range: an int64 id of 2**40 narrowed to
    int32 unchecked (it became 0), and ids out of the vocabulary passed the check, also when
    written through an array held from before a later write cached a range again, or through
    a view's array. The ops' own reads keep the cache trusted (no device wait)."""
    t = fm.tensor([1, 2, 3])
    t.data[0] = 2**40
    with pytest.raises(fm.DTypeError, match="values 2..1099511627776 do not fit int32"):
        t.to("int32")
    ids = fm.tensor([[1, 2]], dtype="int32")
    raw = ids.data
    ops.assign(ids, [[3, 4]])          # one view: written in place, its range cached
    raw[0, 0] = -1
    with pytest.raises(ShapeError, match="token id -1 is out of range; ids must be in 0..7"):
        ops.check_ids("forward", ids, 8)
    viewed = fm.tensor([[1, 2]])
    viewed.reshape(2).data[1] = 9
    with pytest.raises(ShapeError, match="embedding: token id 9 is out of range"):
        ops.embedding(viewed, fm.zeros((8, 2)), fm.zeros((4, 2)))
    fresh = fm.tensor([[1, 2]])
    ops.embedding(fresh, fm.zeros((8, 2)), fm.zeros((4, 2)))
    ops.scatter_add_rows(fm.zeros((8, 2)), fresh.reshape(2), fm.zeros((2, 2)))
    ops.cross_entropy(fm.zeros((2, 8)), fresh.reshape(2))
    assert fresh._id_range() == (1, 2)


@pytest.mark.parametrize("shape", [(2.5,), (True, 2), ("3",), None, (-1, 2)])
def test_zeros_and_full_refuse_a_shape_that_is_not_ints(shape):
    """A float size was truncated (zeros((2.5,)) had 2 elements); now a ShapeError."""
    with pytest.raises(ShapeError, match="shape"):
        fm.zeros(shape)
    with pytest.raises(ShapeError, match="shape"):
        fm.full(shape, 1.0)


@pytest.mark.parametrize("data,dtype", [
    (np.array([2 ** 40], np.int64), "int32"),           # wrapped to 0
    (np.array([2 ** 63 + 5], np.uint64), "int64"),      # wrapped to a negative id
    (np.array([1e20]), "int64"), (np.array([2.0 ** 31]), "int32"),
    ([2 ** 70], None), ([[1, 2], [3]], None),           # NumPy's OverflowError / ValueError
])
def test_values_that_do_not_fit_the_integer_dtype_are_refused(data, dtype):
    from forge_ml.errors import DTypeError
    with pytest.raises(DTypeError, match="tensor:"):
        fm.tensor(data, dtype=dtype)


def test_integer_edges_and_float_truncation_are_kept():
    assert fm.tensor(np.array([2 ** 31 - 1, -2 ** 31]), dtype="int32").numpy().tolist() == [2 ** 31 - 1, -2 ** 31]
    assert fm.tensor(np.array([2 ** 63 - 1]), dtype="int64").numpy().tolist() == [2 ** 63 - 1]
    assert fm.tensor(np.array([3.7, -2.2]), dtype="int32").numpy().tolist() == [3, -2]   # as torch


def test_numpy_reads_a_cpu_tensor_through_the_array_protocol():
    """np.asarray(t) gave a 0-d object array holding the Tensor (it had no ``__array__``), so
    np.testing, np.stack and friends saw one opaque object. Now NumPy 2's protocol: the data
    as it is (a read-only view: writes go through ops, copy-on-write), a copy where a dtype or
    ``copy=True`` asks for one, and a ValueError where ``copy=False`` cannot be kept."""
    t = fm.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = np.asarray(t)
    assert a.dtype == np.float32 and a.shape == (2, 2) and a.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert np.shares_memory(a, t.memory()) and not a.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a[0, 0] = 9.0                                   # the tensor stays as the ops left it
    assert np.shares_memory(np.asarray(t, dtype=np.float32), t.memory())
    assert np.shares_memory(np.array(t, copy=False), t.memory())
    c = np.array(t)                                     # np.array copies by default
    assert not np.shares_memory(c, t.memory()) and c.flags.writeable and c.tolist() == a.tolist()
    c[0, 0] = 9.0
    assert t.numpy()[0, 0] == 1.0
    d = np.asarray(t, dtype=np.float64)
    assert d.dtype == np.float64 and d.tolist() == a.tolist() and d.flags.writeable
    with pytest.raises(ValueError, match="copy"):
        np.array(t, dtype=np.float64, copy=False)
    ids = fm.tensor([3, 1, 4])
    assert np.asarray(ids).dtype == np.int64 and np.asarray(ids).tolist() == [3, 1, 4]
    assert np.asarray(fm.tensor(2.5)).shape == () and float(np.asarray(fm.tensor(2.5))) == 2.5
    assert np.asarray(t.reshape(4)).tolist() == [1.0, 2.0, 3.0, 4.0]
    np.testing.assert_array_equal(t, [[1.0, 2.0], [3.0, 4.0]])
    # (review) NumPy's operators and ufuncs still refuse a Tensor, as on every device: with
    # __array__ alone, t * np.float32(2) became a plain ndarray on the CPU only
    for f in (lambda: t * np.float32(2), lambda: np.float64(1) + t, lambda: np.add(t, 1)):
        with pytest.raises(TypeError):
            f()
    assert np.stack([t, t]).shape == (2, 2, 2)


def test_numpy_refuses_a_tensor_in_device_memory_and_names_the_host_copy(monkeypatch):
    """A tensor whose memory is not the host's is not converted silently (a device wait and a
    copy behind an np.asarray): a TypeError, as PyTorch's, that names t.numpy() and t.to('cpu')."""
    import importlib
    import types
    tensor_mod = importlib.import_module("forge_ml.tensor")   # (fm.tensor is the function)
    dev = fm.Device("cuda", 0)
    fake = types.SimpleNamespace(host_memory=False, select=None)   # no GPU needed
    monkeypatch.setitem(tensor_mod._BACKENDS, dev, fake)
    t = fm.Tensor(np.zeros(2, np.float32), dev)
    for convert in (np.asarray, np.array, lambda x: np.asarray(x, dtype=np.float64)):
        with pytest.raises(TypeError, match=r"can't convert a cuda:0 tensor to NumPy implicitly.*"
                                            r"t\.numpy\(\).*t\.to\('cpu'\)"):
            convert(t)


def test_numpy_reads_a_bfloat16_tensor_as_float32_as_numpy_does():
    """``Tensor.numpy()`` gives bfloat16 as float32 (NumPy has no bfloat16); so does the array
    protocol, as a copy (copy=False cannot hold)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = fm.Tensor(np.array([1.5, -2.0], ml_dtypes.bfloat16), fm.Device("cpu"))
    a = np.asarray(t)
    assert a.dtype == np.float32 and a.tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="copy"):
        np.array(t, copy=False)


def test_dtype_none_is_the_default_or_an_error_never_float64():
    """``dtype=None`` went through np.dtype(None), which is float64: zeros and full gave float64
    tensors and ``t.to(None)`` turned int64 ids into float64. Now the factories take None as
    their default (float32) and ``to`` and ``dtype.get`` refuse it."""
    assert fm.zeros((2,), dtype=None).dtype == fm.float32
    assert fm.full((2,), 1.0, dtype=None).dtype == fm.float32
    with pytest.raises(fm.DTypeError, match="expected a dtype .* got None"):
        fm.dtype.get(None)
    ids = fm.tensor([1, 2])
    with pytest.raises(fm.DeviceError, match="expected a device .* or a dtype .* got None"):
        ids.to(None)
    assert ids.dtype == fm.int64


def test_a_host_allocation_too_large_is_an_out_of_memory_error_saying_what_was_asked():
    """NumPy's own MemoryError (and its ValueError for a size past the address space) came out
    of the CPU backend raw; it is forge-ml's OutOfMemoryError now, still a MemoryError, naming
    the op, NumPy's account of the size and the host's free memory."""
    # (NumPy's own MemoryError stood in for: whether a 3.6 TiB array fails at once depends on
    # the host's overcommit setting, and where it does not, writing it gets the process killed)
    def refuse(*a, **k):
        raise MemoryError("Unable to allocate 3.64 TiB for an array with shape (1000000, "
                          "1000000) and data type float32")
    cases = [("zeros", lambda: fm.zeros((2 ** 62, 4)), "array is too big", None),
             ("zeros", lambda: fm.zeros((10 ** 6, 10 ** 6)), "3.64 TiB", "zeros"),
             ("full", lambda: fm.full((10 ** 6, 10 ** 6), 1.0), "3.64 TiB", "full")]
    for op, make, said, numpy_fn in cases:
        with pytest.MonkeyPatch.context() as mp:
            if numpy_fn:
                mp.setattr(np, numpy_fn, refuse)
            with pytest.raises(fm.OutOfMemoryError) as e:
                make()
        assert isinstance(e.value, MemoryError)
        assert str(e.value).startswith(f"out of host memory: {op} ") and said in str(e.value)
        assert "free" in str(e.value)
    # a kernel's own output: the backend's function is guarded, not only the factories
    from forge_ml.backends import load
    with pytest.MonkeyPatch.context() as mp:
        for name in ("empty", "empty_like", "matmul"):   # (the C kernels' output, NumPy's)
            mp.setattr(np, name, refuse)
        with pytest.raises(fm.OutOfMemoryError, match="out of host memory: matmul "):
            load("cpu").matmul(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32))


def test_ones_like_names_what_it_was_given():
    with pytest.raises(fm.DTypeError, match="ones_like: expected a forge_ml Tensor, got list"):
        fm.ones_like([1, 2])
    from forge_ml.models import GPT2Config
    with pytest.raises(fm.ConfigError, match="from_dict: expected a dict .* got NoneType"):
        GPT2Config.from_dict(None)
