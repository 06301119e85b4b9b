"""Every Mosaic GPU kernel lowers for CUDA on this host, GPU or not, within a time bound, and
compiles into an H100 executable where JAX's CUDA plugin is installed.

``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` runs Mosaic GPU's whole
lowering, layout inference included, with no GPU and no CUDA plugin: an op or a layout that
Mosaic GPU rejects fails here. A layout search that would take minutes fails when the bound
runs out. With the plugin (the ``cuda12`` extra), each kernel is also compiled by XLA:GPU for
a deviceless H100 (``sharding.gpu_mesh``), the Mosaic GPU call inside the executable. What
neither can catch (the PTX stage, the numerics) is in docs/gpu.md.
"""

import threading

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding
from test_pallas import BITS, DTYPE_IDS, DTYPES, LAYOUT_IDS, LAYOUTS

import jax_bytegrad
from jax_bytegrad._src.codecs import Codec
from jax_bytegrad._src.codecs import pallas as _pallas
from jax_bytegrad.sharding import gpu_mesh

# One kernel lowers in about a second and compiles for an H100 in a few more; a layout search
# that does not converge takes minutes.
LOWERING_TIMEOUT_S = 120.0
KERNEL_CALL = "custom_call @mosaic_gpu"
# How the compiled executable's HLO calls the kernel.
COMPILED_CALL = 'custom_call_target="mosaic_gpu'
# The layouts of test_pallas.py, plus the default tile at the block counts of its
# non-finite (4 blocks) and extreme-magnitude (2 blocks) tests.
ALL_LAYOUTS = [*LAYOUTS, (4, 128, _pallas._Tiles()), (2, 128, _pallas._Tiles())]
ALL_LAYOUT_IDS = [*LAYOUT_IDS, "default4", "default2"]
ROUNDINGS = [pytest.param(False, id="nearest"), pytest.param(True, id="stochastic")]
KEY = jax.eval_shape(jax.random.key, 0)


def _deviceless_h100():
    """One deviceless H100, or None without JAX's CUDA plugin."""
    try:
        return gpu_mesh(1, 1).devices[0, 0]
    except RuntimeError:
        return None


H100 = _deviceless_h100()


def lower_for_cuda(fn, *args) -> str:
    """Lowers ``jax.jit(fn)`` for CUDA in a thread, and compiles it for an H100 where the
    CUDA plugin is installed; fails if that takes over the bound."""
    outcome = {}

    def work():
        try:
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            outcome["text"] = lowered.as_text()
            if H100 is not None:
                on_h100 = SingleDeviceSharding(H100)
                placed = jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_h100), args
                )
                compiled = jax.jit(fn).trace(*placed).lower().compile()
                assert COMPILED_CALL in compiled.as_text(), "no Mosaic GPU call in the executable"
        except Exception as error:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = error

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(LOWERING_TIMEOUT_S)
    if worker.is_alive():
        pytest.fail(
            f"lowering (and compiling) for CUDA did not finish within {LOWERING_TIMEOUT_S:g} s"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["text"]


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("num_blocks", "block_size", "tiles"), ALL_LAYOUTS, ids=ALL_LAYOUT_IDS)
def test_quantize_kernel_lowers_for_cuda(num_blocks, block_size, tiles, dtype, stochastic, bits):
    block_size = block_size * 8 // bits

    def fn(x, key):
        codec = Codec(bits=bits, stochastic=stochastic)
        return _pallas.quantize_blocks(codec, x, key if stochastic else None, tiles=tiles)

    text = lower_for_cuda(fn, spec((num_blocks, block_size), dtype), KEY)
    assert KERNEL_CALL in text


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(("num_blocks", "block_size", "tiles"), ALL_LAYOUTS, ids=ALL_LAYOUT_IDS)
def test_dequantize_kernel_lowers_for_cuda(num_blocks, block_size, tiles, bits):
    code_width = block_size  # a layout's block size is its code width at 8 bits

    def fn(codes, header):
        return _pallas.dequantize_blocks(Codec(bits=bits), codes, header, tiles=tiles)

    text = lower_for_cuda(
        fn, spec((num_blocks, code_width), jnp.uint8), spec((num_blocks, 2), jnp.float32)
    )
    assert KERNEL_CALL in text


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", ROUNDINGS)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(("num_blocks", "block_size", "tiles"), LAYOUTS[:3], ids=LAYOUT_IDS[:3])
def test_average_requantize_kernel_lowers_for_cuda(
    num_blocks, block_size, tiles, n, stochastic, bits
):
    def fn(codes, header, key):
        codec = Codec(bits=bits, stochastic=stochastic)
        key = key if stochastic else None
        return _pallas.average_requantize(codec, codes, header, key, weight=1.0 / n, tiles=tiles)

    text = lower_for_cuda(
        fn,
        spec((n, num_blocks, block_size), jnp.uint8),
        spec((n, num_blocks, 2), jnp.float32),
        KEY,
    )
    assert KERNEL_CALL in text


# --- The public API, as an AOT user lowers or exports it from a host without a GPU. ------

PUBLIC_DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
SHAPE = (3, 1000)  # not a whole number of blocks: the tail block is padded


def public_quantize_array(bits, stochastic):
    def fn(x, key):
        return jax_bytegrad.quantize(
            x,
            bits=bits,
            rounding="stochastic" if stochastic else "nearest",
            key=key if stochastic else None,
            implementation="pallas",
        )

    return fn


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", ROUNDINGS)
@pytest.mark.parametrize("dtype", PUBLIC_DTYPES)
def test_public_quantize_lowers_for_cuda(dtype, stochastic, bits):
    text = lower_for_cuda(public_quantize_array(bits, stochastic), spec(SHAPE, dtype), KEY)
    assert text.count(KERNEL_CALL) == 1


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", ROUNDINGS)
@pytest.mark.parametrize("dtype", PUBLIC_DTYPES)
def test_public_dequantize_lowers_for_cuda(dtype, stochastic, bits):
    # The rounding that made the codes does not change the decoder; both are lowered anyway,
    # as a user would decode them.
    q = jax.eval_shape(public_quantize_array(bits, stochastic), spec(SHAPE, dtype), KEY)
    text = lower_for_cuda(lambda q: jax_bytegrad.dequantize(q, implementation="pallas"), q)
    assert text.count(KERNEL_CALL) == 1


@pytest.mark.parametrize("bits", BITS)
def test_public_api_exports_for_cuda(bits):
    def roundtrip(x):
        q = jax_bytegrad.quantize(x, bits=bits, implementation="pallas")
        return jax_bytegrad.dequantize(q, implementation="pallas")

    exported = jax.export.export(jax.jit(roundtrip), platforms=["cuda"])(spec(SHAPE, jnp.float32))
    assert exported.platforms == ("cuda",)
    assert exported.out_avals[0].shape == SHAPE
    assert exported.mlir_module().count(KERNEL_CALL) == 2


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_lowering_pallas_for_another_platform_raises_clearly(platform):
    fn = jax.jit(lambda x: jax_bytegrad.quantize(x, implementation="pallas").codes)
    with pytest.raises(NotImplementedError, match="being lowered for another platform"):
        jax.export.export(fn, platforms=[platform])(spec(SHAPE, jnp.float32))
    with pytest.raises(NotImplementedError, match="being lowered for another platform"):
        fn.trace(spec(SHAPE, jnp.float32)).lower(lowering_platforms=(platform,))
