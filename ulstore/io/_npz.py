"""``.npz`` archives, with ulstore's convention for bf16 and fp8 (see :mod:`ulstore.io.checkpoints`)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from ..core.dtypes import ML_DTYPES, RAW_BITS
from ..core.safetensors import first_line
from ..errors import InvalidInputError, NotFoundError
from ._files import Checkpoint, _atomic_path, _bad, _le_contiguous, _prepare

__all__ = ["load_npz", "save_npz"]

_NPZ_DTYPES_KEY = "__dtypes__"


def load_npz(path) -> Checkpoint:
    """Read an ``.npz`` archive, restoring bf16/fp8 listed in ``__dtypes__``.

    Examples
    --------
    >>> import tempfile, numpy as np, ml_dtypes
    >>> p = Path(tempfile.mkdtemp()) / "m.npz"
    >>> save_npz({"w": np.ones(2, ml_dtypes.float8_e5m2)}, p)
    >>> load_npz(p).tensors["w"].dtype
    dtype(float8_e5m2)
    """
    p = Path(path)
    try:
        archive = np.load(p, allow_pickle=False)
    except FileNotFoundError:
        raise NotFoundError(f"{p}: no such npz file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise _bad(p, f"cannot read: {first_line(e)}", kind="npz") from e
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise _bad(p, "is a single .npy array, not an .npz archive", kind="npz")
    with archive:
        try:
            special = _npz_dtypes(p, archive)
            tensors = {}
            for name in archive.files:
                if name == _NPZ_DTYPES_KEY:
                    continue
                arr = archive[name]
                if not isinstance(arr, np.ndarray):  # numpy hands back the bytes of a member that is not npy data
                    member = f"{name}.npy" if f"{name}.npy" in archive.zip.namelist() else name
                    raise _bad(
                        p,
                        f"member {member!r} is not npy data (no .npy header): an .npz archive holds arrays only",
                        kind="npz",
                    )
                arr = _le_contiguous(name, arr)
                if name in special:
                    want = special.pop(name)
                    if arr.dtype != RAW_BITS[want]:
                        raise _bad(
                            p, f"member {name!r} is {arr.dtype}, but {want.name} needs {RAW_BITS[want]}", kind="npz"
                        )
                    arr = arr.view(want)
                tensors[name] = arr
        except InvalidInputError as e:
            if str(p) in e.message:
                raise
            raise type(e)(f"{p}: {e.message}") from None  # e.g. a DtypeError: name the file
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise _bad(p, f"cannot read: {first_line(e)}", kind="npz") from e
    if special:
        raise _bad(p, f"{_NPZ_DTYPES_KEY} names missing member {next(iter(special))!r}", kind="npz")
    return Checkpoint(tensors)


def save_npz(tensors, path) -> None:
    """Write an uncompressed ``.npz`` atomically (bf16/fp8 per the module convention).

    Examples
    --------
    >>> import tempfile, numpy as np, ml_dtypes
    >>> p = Path(tempfile.mkdtemp()) / "m.npz"
    >>> save_npz({"w": np.ones(2, ml_dtypes.bfloat16)}, p)
    >>> with np.load(p) as z:
    ...     z["w"].dtype, str(z["__dtypes__"])
    (dtype('uint16'), '{"w": "bfloat16"}')
    """
    arrays = _prepare(tensors, reserved=(_NPZ_DTYPES_KEY,))
    special = {}
    for name, arr in arrays.items():
        if arr.dtype in RAW_BITS:
            special[name] = arr.dtype.name
            arrays[name] = arr.view(RAW_BITS[arr.dtype])
    if special:
        arrays[_NPZ_DTYPES_KEY] = np.array(json.dumps(special))
    with _atomic_path(Path(path)) as tmp:
        # What np.savez does, minus its keyword arguments: a tensor named
        # "file" or "allow_pickle" would collide with them.
        with zipfile.ZipFile(tmp, "x", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in arrays.items():
                with zf.open(name + ".npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, arr, allow_pickle=False)


def _npz_dtypes(p: Path, archive) -> dict[str, np.dtype]:
    if _NPZ_DTYPES_KEY not in archive.files:
        return {}
    raw = archive[_NPZ_DTYPES_KEY]
    try:
        spec = json.loads(str(raw[()])) if raw.dtype.kind == "U" and raw.ndim == 0 else None
    except ValueError:
        spec = None
    if not isinstance(spec, dict) or not all(v in ML_DTYPES for v in spec.values()):
        raise _bad(p, f"{_NPZ_DTYPES_KEY} is not JSON of name -> one of {sorted(ML_DTYPES)}", kind="npz")
    return {k: ML_DTYPES[v] for k, v in spec.items()}
