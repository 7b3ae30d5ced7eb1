"""ULPack as a zarr v3 codec: ``zarr.create_array(..., serializer=ULPack())``.

:class:`ULPack` here is a zarr v3 ``ArrayBytesCodec`` (array -> bytes, so it
takes the place of zarr's ``bytes`` serializer), named ``"ulpack"`` in array
metadata.  It is registered with zarr through the ``zarr.codecs`` entry-point
group (so an array written with it opens in a fresh interpreter that never
imported ulstore) and with :func:`zarr.registry.register_codec` when this
module is imported (so it also works from a source tree that was not
installed).

Every chunk is coded *intra*, against +0.0: a zarr codec sees one chunk and its
:class:`~zarr.core.array_spec.ArraySpec` (shape, dtype, fill value), never which
chunk it is, so it cannot find a reference chunk.  Delta coding against earlier
checkpoints is what :func:`ulstore.open` trajectories do below zarr.  Intra
coding still removes the redundancy of the exponents and the top mantissa bits
(see docs/format.md); it is exact for every bit pattern, as ULPack always is.

Pass ``compressors=None``: zarr otherwise appends its default zstd compressor,
which spends time on ULPack's output (already entropy-coded) for nothing.

Dtypes: the six formats ULPack codes, float16, bfloat16, float32, float64,
float8_e4m3fn and float8_e5m2 (bfloat16 and fp8 as the zarr data types of
:mod:`ulstore.codec._zarr_dtypes`, registered when this module is imported); other
dtypes are refused when the array is created.

The numcodecs codec :class:`ulstore.codec.ULPack` (``{"id": "ulpack"}``) is a
different object for numcodecs users and zarr v2; zarr v3 wants this one.

Examples
--------
>>> import ml_dtypes, numpy as np, zarr
>>> from ulstore.codec.zarr3 import ULPack  # also registers the bfloat16 and fp8 zarr data types
>>> x = np.linspace(-1, 1, 64, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(8, 8)
>>> a = zarr.create_array(
...     store={}, shape=x.shape, chunks=(4, 8), dtype=x.dtype, serializer=ULPack(), compressors=None
... )
>>> a[:] = x
>>> a.metadata.to_dict()["codecs"]
({'name': 'ulpack', 'configuration': {'econd': True}},)
>>> bool((a[:].view(np.uint16) == x.view(np.uint16)).all())
True
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.common import parse_named_configuration
from zarr.registry import register_codec

from ..errors import CorruptBlobError, DtypeError
from ._api import decode, encode
from ._dtypes import format_of
from ._zarr_dtypes import ZARR_NAMES, register, zarr_dtype

__all__ = ["ULPack", "CODEC_NAME", "ZARR_NAMES", "register", "zarr_dtype"]

#: The codec's name in zarr v3 array metadata.
CODEC_NAME = "ulpack"


@dataclass(frozen=True)
class ULPack(ArrayBytesCodec):
    """ULPack as a zarr v3 array -> bytes codec (intra: every chunk on its own).

    Parameters
    ----------
    econd : bool, default True
        Condition the models on the reference exponent (for intra blobs the
        reference is +0.0, so this only changes the blob's flags; kept for
        parity with :func:`ulstore.encode`).

    Notes
    -----
    zarr skips writing a chunk whose values all equal the fill value (unless
    the array's config has ``write_empty_chunks=True``) and compares *values*
    there, not bits: a chunk of -0.0 in a bfloat16 array whose fill value is
    0.0, or a float32 chunk of NaNs whose payload differs from the fill
    value's, then reads back as the fill value.  That is zarr's choice, before
    any codec runs; pass ``config={"write_empty_chunks": True}`` to
    ``zarr.create_array`` when such chunks must survive bit for bit.
    """

    is_fixed_size = False
    econd: bool = True

    def __init__(self, *, econd: bool = True) -> None:
        if not isinstance(econd, bool):
            raise TypeError(f"econd must be True or False, not {econd!r}")
        object.__setattr__(self, "econd", econd)

    @classmethod
    def from_dict(cls, data):
        """The codec from its JSON form ``{"name": "ulpack", "configuration": {"econd": true}}``."""
        _, configuration = parse_named_configuration(data, CODEC_NAME, require_configuration=False)
        configuration = dict(configuration or {})
        unknown = set(configuration) - {"econd"}
        if unknown:
            raise ValueError(f"unknown {CODEC_NAME} codec configuration {sorted(unknown)}; expected only 'econd'")
        return cls(**configuration)

    def to_dict(self) -> dict:
        return {"name": CODEC_NAME, "configuration": {"econd": self.econd}}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        """Refuse, when the array is created, a dtype ULPack does not code."""
        native = dtype.to_native_dtype()
        try:
            format_of(native)
        except DtypeError:
            raise ValueError(
                f"the {CODEC_NAME} codec codes float16, bfloat16, float32, float64, float8_e4m3fn and "
                f"float8_e5m2 arrays, not {native}; use zarr's default serializer for other dtypes"
            ) from None

    def compute_encoded_size(self, input_byte_length: int, chunk_spec) -> int:
        raise NotImplementedError  # variable-size output, as for every compressor

    # -- one chunk ------------------------------------------------------------------------

    def _decode_sync(self, chunk_bytes, chunk_spec):
        want = chunk_spec.dtype.to_native_dtype()
        # the chunk's shape is known: a blob declaring another is refused before its values are allocated
        arr = decode(chunk_bytes.as_numpy_array(), shape=tuple(chunk_spec.shape))
        if arr.dtype.newbyteorder("=") != want.newbyteorder("=") or arr.size != int(np.prod(chunk_spec.shape)):
            raise CorruptBlobError(
                f"ulpack chunk decodes to {arr.dtype} {list(arr.shape)}, not the array's {want} {list(chunk_spec.shape)}"
            )
        if arr.dtype != want:
            arr = arr.astype(want)  # the array's byte order: a value-exact swap
        return chunk_spec.prototype.nd_buffer.from_numpy_array(arr.reshape(chunk_spec.shape))

    def _encode_sync(self, chunk_array, chunk_spec):
        arr = np.ascontiguousarray(chunk_array.as_numpy_array())
        return chunk_spec.prototype.buffer.from_bytes(encode(arr, None, econd=self.econd))

    # zarr 3.1 calls these; the kernels release the GIL, so a thread keeps zarr's event loop free
    async def _decode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    async def _encode_single(self, chunk_array, chunk_spec):
        return await asyncio.to_thread(self._encode_sync, chunk_array, chunk_spec)


register_codec(CODEC_NAME, ULPack)
