"""``decode_blobs``: many blobs decoded into the caller's buffers, the compiled decoder entered here.

A store's read decodes the root of each reference chain (and each dense delta) whole.  This
door decodes a list of them into buffers the caller gives (views of the arrays it returns),
calling the kernel itself for version-3 RANS and INTRA payloads (every blob a store writes
now: ``decode3``, one call for the payload's checks, tables and decode), so that a read
reaches the kernel in few calls; other blobs go through
:func:`~._api.decode_into`.  Each value's word sum comes back too (what a SPARSE delta
applied on it next checks its reference against), free for the version-3 payloads: the
kernel's ``hash64`` of the values is unmixed.  Checks are :func:`~._api.decode`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import CorruptBlobError, ReferenceMismatchError
from . import _format as F
from ._api import (
    _check_end,
    _check_reference,
    _dest_words,
    _econd_mask,
    _open,
    _target_hash,
    decode3_args,
    decode_into,
)
from ._backend import kernels
from ._checksum import GOLDEN, MASK64, fold32
from ._one_stream import section3_args, status_error

__all__ = ["decode_blobs", "word_sum_of"]

_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_INV1, _INV2 = pow(_M1, -1, 1 << 64), pow(_M2, -1, 1 << 64)


def _unshift(z: int, s: int) -> int:
    """The x with ``x ^ (x >> s) == z`` (64 bits)."""
    x = z
    for _ in range(64 // s):
        x = z ^ (x >> s)
    return x


def word_sum_of(h: int, nbytes: int) -> int:
    """The word sum whose ``finish_sum(., nbytes)`` is ``h``: the mix is a bijection of 64-bit words."""
    z = _unshift(h, 31)
    z = (z * _INV2) & MASK64
    z = _unshift(z, 27)
    z = (z * _INV1) & MASK64
    z = _unshift(z, 30)
    return (z - nbytes * GOLDEN) & MASK64


class _Payload:
    """One version-3 blob opened and checked up to the kernel call: its arguments, then :meth:`finish`."""

    __slots__ = ("k", "header", "rd", "rf", "args")

    def __init__(self, k, header: F.Header, rd: F.Reader, rf, args: tuple):
        self.k, self.header, self.rd, self.rf, self.args = k, header, rd, rf, args

    def finish(self, status: int) -> int:
        """Check what the kernel did (status, the payload's end, reference, target); the values' word sum."""
        h, hashes = self.header, self.args[-1]
        try:
            if status:
                raise status_error(status)
            _check_end(self.rd)
        except CorruptBlobError:
            _check_reference(self.k, h, self.rf)  # a wrong reference is the likelier cause: say so
            raise
        if self.rf is not None and fold32(int(hashes[1])) != h.ref_hash:
            raise ReferenceMismatchError("reference does not match the one this ULPack blob was coded against")
        if _target_hash(self.k, h.fmt, h.shape, int(hashes[0])) != h.target_hash:
            raise CorruptBlobError("ULPack blob decodes to values that fail the target checksum")
        return word_sum_of(int(hashes[0]), h.size * h.fmt.width // 8)


def _payload(k, header: F.Header, rd: F.Reader, rf, words, emask: int) -> _Payload:
    """The version-3 RANS or INTRA payload at ``rd`` of ``header``, checked up to the kernel call (step by step)."""
    fmt = header.fmt

    def verify(values_hash: int) -> None:
        if _target_hash(k, fmt, header.shape, values_hash) != header.target_hash:
            raise CorruptBlobError("ULPack blob decodes to values that fail the target checksum")

    try:
        args = section3_args(k, fmt, header, rd, rf, emask, verify, words)
    except CorruptBlobError:
        _check_reference(k, header, rf)
        raise
    return _Payload(k, header, rd, rf, args)


def _at_once_sum(k, header: F.Header, rf, result: tuple) -> int | None:
    """The values' word sum from ``decode3``'s ``result``, checked (reference, target); None if anything failed
    (the step-by-step path then decodes the blob again and names what is wrong)."""
    status, _, values_hash, ref_hash = result
    if status or (rf is not None and fold32(ref_hash) != header.ref_hash):
        return None
    if _target_hash(k, header.fmt, header.shape, values_hash) != header.target_hash:
        return None
    return word_sum_of(values_hash, header.size * header.fmt.width // 8)


def decode_blobs(
    blobs: Sequence, references: Sequence, outs: Sequence[np.ndarray], shapes: Sequence, *, backend=None
) -> list[int | None]:
    """Decode ULPack ``blobs[i]`` against ``references[i]`` (None: intra) into ``outs[i]``, in order.

    ``outs[i]``: a writable C-contiguous array of the blob's dtype and ``shapes[i]`` (the shape the
    blob must declare), not overlapping ``references[i]``.  Returns each value's word sum
    (:func:`content_sum`) where it came free (version-3 RANS and INTRA payloads), else None.
    Raises as :func:`decode` does, at the first blob that fails; what the outs hold then is
    unspecified.
    """
    k = kernels(backend)
    sums: list[int | None] = []
    at_once = hasattr(k, "decode3")  # (a kernel build older than its sources lacks it: the step-by-step path)
    for blob, ref, out, shape in zip(blobs, references, outs, shapes):
        header, rd, rf = _open(blob, ref, shape)  # (once: its CRC is a pass over the blob)
        if header.version < 3 or header.mode not in (F.MODE_RANS, F.MODE_INTRA):
            decode_into(blob, ref, out, shape=shape, backend=backend)
            sums.append(None)
            continue
        words = _dest_words(header.fmt, header.size, out)
        emask = _econd_mask(header.fmt, rf is not None, not header.flags & F.FLAG_NO_ECOND)
        if at_once:  # one kernel call, entered from the door; on any failure the step-by-step path names it
            done = _at_once_sum(k, header, rf, k.decode3(*decode3_args(header, rd, rf, words, emask)))
            if done is not None:
                sums.append(done)
                continue
        job = _payload(k, header, rd, rf, words, emask)
        sums.append(job.finish(k.rans_decode3(*job.args)))  # the kernel, entered from the door
    return sums
