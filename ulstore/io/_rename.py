"""Tensor names across steps: how much of a parent a checkpoint matches by name, and prefix renaming.

A step is delta-coded tensor by tensor against the parent tensor *of the same
name* (same shape and dtype).  A fine-tune saved with other names (a base
model's ``embeddings.word_embeddings.weight`` saved as
``bert.embeddings.word_embeddings.weight`` by a task head) therefore shares
nothing with its base and costs as much as storing it alone.
:func:`name_overlap` measures that, :func:`suggest_prefixes` finds the prefix
mapping that would line the names up, and :func:`rename_prefixes` applies one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..core.formatting import describe_retyped
from ..errors import FewSharedNamesWarning, InvalidInputError

__all__ = [
    "FewSharedNamesWarning",
    "MIN_SHARED",
    "name_overlap",
    "retyped",
    "describe_retyped",
    "suggest_prefixes",
    "rename_prefixes",
]

#: Below this fraction of the parent's bytes matched by name (and of the checkpoint's own),
#: :func:`ulstore.io.import_checkpoint` warns.
MIN_SHARED = 0.5
#: How many leading name components a suggested prefix may span.
_MAX_PREFIX_PARTS = 3


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def name_overlap(parent: Mapping, child: Mapping) -> float:
    """Fraction of the parent's bytes that ``child`` matches by name, shape and dtype (1.0 for an empty parent).

    Both map tensor name -> (shape, dtype) (:meth:`Trajectory.tensors`, or arrays' shapes and dtypes).

    Examples
    --------
    >>> import numpy as np
    >>> f4 = np.dtype(np.float32)
    >>> name_overlap({"a": ((4,), f4), "b": ((12,), f4)}, {"a": ((4,), f4), "x.b": ((12,), f4)})
    0.25
    """
    total = sum(_nbytes(*v) for v in parent.values())
    if not total:
        return 1.0
    matched = sum(_nbytes(*v) for name, v in parent.items() if child.get(name) == v)
    return matched / total


def retyped(parent: Mapping, child: Mapping) -> dict:
    """The tensors both hold by name with another shape or dtype: name -> (parent's (shape, dtype), child's).

    Such a tensor is stored whole (a delta needs its parent's shape and dtype), and no renaming helps.

    Examples
    --------
    >>> import numpy as np
    >>> bf, f4 = np.dtype(np.float16), np.dtype(np.float32)
    >>> retyped({"a": ((4,), bf), "b": ((2,), f4)}, {"a": ((4,), f4), "b": ((2,), f4), "c": ((1,), f4)})
    {'a': (((4,), dtype('float16')), ((4,), dtype('float32')))}
    """
    return {name: (parent[name], v) for name, v in child.items() if name in parent and parent[name] != v}


def suggest_prefixes(parent: Mapping, child: Mapping) -> dict[str, str]:
    """The one prefix renaming ``{OLD: NEW}`` of ``child``'s names that matches the most parent bytes.

    Looks at the names that do not match, strips up to three leading dotted
    components from each side and pairs names whose remainders agree (with
    equal shape and dtype).  Returns ``{}`` when no renaming matches more
    than the names do already.

    Examples
    --------
    >>> import numpy as np
    >>> f4 = np.dtype(np.float32)
    >>> base = {"embeddings.w": ((8,), f4), "encoder.layer.0.w": ((8,), f4)}
    >>> tuned = {"bert.embeddings.w": ((8,), f4), "bert.encoder.layer.0.w": ((8,), f4), "classifier.w": ((2,), f4)}
    >>> suggest_prefixes(base, tuned)
    {'bert.': ''}
    >>> suggest_prefixes(tuned, base)
    {'': 'bert.'}
    """
    unmatched_parent = {n: v for n, v in parent.items() if child.get(n) != v}
    by_rest: dict[tuple, list[str]] = {}  # (remainder, shape, dtype) -> parent prefixes
    for name, v in unmatched_parent.items():
        for prefix, rest in _splits(name):
            by_rest.setdefault((rest, *v), []).append(prefix)
    votes: dict[tuple[str, str], int] = {}
    for name, v in child.items():
        if parent.get(name) == v:
            continue
        seen = set()
        for old, rest in _splits(name):
            for new in by_rest.get((rest, *v), ()):
                if (old, new) != ("", "") and (old, new) not in seen:
                    seen.add((old, new))
                    votes[(old, new)] = votes.get((old, new), 0) + _nbytes(*v)
    if not votes:
        return {}
    (old, new), _ = max(votes.items(), key=lambda kv: (kv[1], -len(kv[0][0]) - len(kv[0][1])))
    return {old: new}


def _splits(name: str):
    """``"a.b.c.d"`` -> ("", "a.b.c.d"), ("a.", "b.c.d"), ("a.b.", "c.d"), ("a.b.c.", "d")."""
    parts = name.split(".")
    for k in range(min(_MAX_PREFIX_PARTS, len(parts) - 1) + 1):
        yield "".join(p + "." for p in parts[:k]), ".".join(parts[k:])


def rename_prefixes(names, mapping: Mapping[str, str]) -> dict[str, str]:
    """``{old name: new name}`` for every name that starts with a prefix of ``mapping`` (longest prefix wins).

    Parameters
    ----------
    names : iterable of str
    mapping : Mapping[str, str]
        OLD prefix -> NEW prefix; OLD ``""`` adds NEW in front of every name.

    Raises
    ------
    InvalidInputError
        A prefix matches no name, or two names would end up the same.

    Examples
    --------
    >>> rename_prefixes(["bert.pooler.w", "bert.embeddings.w", "classifier.w"], {"bert.": ""})
    {'bert.pooler.w': 'pooler.w', 'bert.embeddings.w': 'embeddings.w'}
    """
    names = list(names)
    prefixes = sorted(mapping, key=len, reverse=True)
    renamed: dict[str, str] = {}
    used = set()
    for name in names:
        for old in prefixes:
            if name.startswith(old):
                renamed[name] = mapping[old] + name[len(old) :]
                used.add(old)
                break
    unused = [old for old in mapping if old not in used]
    if unused:
        raise InvalidInputError(f"rename prefix {unused[0]!r} matches no tensor name")
    final = [renamed.get(n, n) for n in names]
    if len(set(final)) != len(final):
        clash = next(n for n in final if final.count(n) > 1)
        raise InvalidInputError(f"renaming prefixes {dict(mapping)} gives two tensors the name {clash!r}")
    return {old: new for old, new in renamed.items() if old != new}
