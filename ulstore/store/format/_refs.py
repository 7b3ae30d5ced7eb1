"""Refs (branches and tags) as append-only logs of sealed entries: read with integrity, move by compare-and-swap.

Read me first
-------------
- A ref is a log: ``refs/<name>/<seq>.json``, ``seq`` in 20 decimal digits (so
  name order is number order).  Its value is the entry with the **highest**
  ``seq``.  Entries are only ever *created*, by the conditional create of
  :meth:`ObjectStore.create` (local disk: ``os.link``; S3: ``If-None-Match: *``;
  memory://: a lock), never overwritten.
- **Compare-and-swap**: a writer that read entry ``k`` moves the ref by
  creating entry ``k + 1``.  If another writer moved it first, the create fails
  and the writer gets :class:`~ulstore.errors.RefMovedError` naming the new
  head: nothing was moved, re-read and retry.  This needs only the primitive the
  commit point already needs (create-if-absent), so refs are compare-and-swap on
  exactly the backends where step commits are race-free.
- Each entry is sealed canonical JSON (:func:`ulstore.core.sealed.seal`) and
  names its ref, its ``seq`` and the checksum of the entry it replaced (a hash
  chain).  A damaged head entry is a :class:`CorruptManifestError` naming its
  key, never a fallback to an older entry (that would silently move the ref).
- Deleting a ref appends a *tombstone* entry (``"step": null``).
- Compaction: every :data:`KEEP` moves, the writer deletes entries more than
  ``KEEP`` below the head.  A writer whose read is so stale that its ``k + 1``
  was compacted away re-creates an old number; it checks after creating that
  its entry is the head or that the entry above it chains to it, and otherwise
  reports :class:`RefMovedError` (its entry lies below the head: inert).
- A format-1 ref ``refs/<name>.json`` (``{"step": n}``, unsealed) is read while
  ``<name>`` has no log; the first move starts the log at ``seq`` 0.

Plain fsspec readers: LIST ``refs/<name>/``, GET the last key, read ``"step"``.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import warnings
from dataclasses import dataclass

from ...core.objects import MAX_DOCUMENT_BYTES, ObjectStore
from ...core.sealed import open_sealed, seal
from ...errors import CorruptManifestError, RefMovedError
from ._layout import MAX_STEP, REFS_DIR, check_step

__all__ = ["RefState", "RefLog", "KEEP", "entry_key", "log_dir", "legacy_key"]

#: Entries kept below the head by compaction.
KEEP = 64
_SEQ_DIGITS = 20
_ENTRY_RE = re.compile(r"^([0-9]{20})\.json\Z")
_LEGACY_RE = re.compile(r"^([^/]+)\.json\Z")
_FIELDS = {"ref", "seq", "step", "replaces", "created", "checksum"}


def log_dir(name: str) -> str:
    """Key prefix of the log of ref ``name``."""
    return f"{REFS_DIR}/{name}"


def entry_key(name: str, seq: int) -> str:
    """Key of entry ``seq`` of ref ``name``."""
    return f"{REFS_DIR}/{name}/{seq:0{_SEQ_DIGITS}d}.json"


def legacy_key(name: str) -> str:
    """Key of a format-1 ref (read only)."""
    return f"{REFS_DIR}/{name}.json"


@dataclass(frozen=True)
class RefState:
    """What a read of a ref saw: the expected value of a later compare-and-swap.

    ``step`` is None when the ref does not exist (never created, or deleted);
    ``seq`` is -1 when it has no log; ``checksum`` is the entry's own and
    ``replaces`` the checksum of the entry before it.
    """

    name: str
    step: int | None
    seq: int = -1
    checksum: str | None = None
    replaces: str | None = None

    @property
    def key(self) -> str:
        return entry_key(self.name, self.seq) if self.seq >= 0 else legacy_key(self.name)


class RefLog:
    """Read, move, list and check refs stored under ``refs/`` of ``io``."""

    def __init__(self, io: ObjectStore):
        self.io = io
        # (key, exact bytes, parse) of the entry read last: a reader polling a ref that did not move
        # parses the same head entry again only if its bytes differ (RefState is immutable)
        self._last: tuple[str, bytes, RefState] | None = None

    # -- reading ------------------------------------------------------------------

    def read(self, name: str) -> RefState:
        """The current value of ref ``name`` (checked).

        Raises
        ------
        CorruptManifestError
            The head entry (or a format-1 ref) is damaged; ``key`` names it.
        """
        for _ in range(8):  # the head can only vanish under a racing compaction: list again
            seq = self._last_seq(name)
            if seq is None:
                return self._legacy(name)
            state = self._entry(name, seq)
            if state is not None:
                return state
        raise CorruptManifestError("ref head keeps vanishing while it is read", key=log_dir(name))

    def names(self) -> dict[str, int]:
        """Every existing ref: name -> step (one LIST of ``refs/`` plus one GET per ref).

        A ref whose head entry is damaged is left out with a warning naming its key, so that one broken
        ref does not stop listing, logging or deleting on the others; reading that ref (:meth:`read`)
        still raises, and :meth:`problems` reports it.
        """
        out = {}
        for name in sorted(self._listing()):
            try:
                state = self.read(name)
            except CorruptManifestError as e:
                warnings.warn(
                    f"ref {name!r} left out of the refs: {e}; the other refs are listed (`ulstore verify` "
                    "reports every damaged entry)",
                    UserWarning,
                    stacklevel=3,
                )
                continue
            if state.step is not None:
                out[name] = state.step
        return out

    def _listing(self) -> dict[str, list[int]]:
        """name -> sorted entry numbers (empty list: a format-1 ref only)."""
        found: dict[str, list[int]] = {}
        for key in self.io.find(REFS_DIR):
            parts = key.split("/")
            if len(parts) == 3 and (m := _ENTRY_RE.match(parts[2])):
                found.setdefault(parts[1], []).append(int(m.group(1)))
            elif len(parts) == 2 and (m := _LEGACY_RE.match(parts[1])):
                found.setdefault(m.group(1), [])
        return {name: sorted(seqs) for name, seqs in found.items()}

    def _seqs(self, name: str) -> list[int]:
        seqs = []
        for key in self.io.list(log_dir(name)):
            m = _ENTRY_RE.match(key.rsplit("/", 1)[-1])
            if m:
                seqs.append(int(m.group(1)))
        return sorted(seqs)

    def _last_seq(self, name: str) -> int | None:
        """The highest entry number of ``name`` (None: no log): what :meth:`read` needs of the listing.

        Entry names are fixed-width numbers, so name order is number order: the last name that is an
        entry is the head, whatever else the listing holds (a log keeps up to twice ``KEEP`` entries).
        """
        for key in reversed(self.io.list(log_dir(name))):
            m = _ENTRY_RE.match(key.rsplit("/", 1)[-1])
            if m:
                return int(m.group(1))
        return None

    def _entry(self, name: str, seq: int) -> RefState | None:
        """Entry ``seq`` of ``name`` checked, or None if it is not there."""
        key = entry_key(name, seq)
        raw = self.io.get(key, limit=MAX_DOCUMENT_BYTES)
        if raw is None:
            return None
        last = self._last
        if last is not None and last[0] == key and last[1] == raw:  # the entry read last, byte for byte
            return last[2]
        state = self._parse_entry(name, seq, key, raw)
        self._last = (key, bytes(raw), state)  # one assignment: a thread sees the old or the new triple
        return state

    @staticmethod
    def _parse_entry(name: str, seq: int, key: str, raw) -> RefState:
        """Entry ``seq`` of ``name`` from its bytes ``raw`` (at ``key``), checked."""

        def bad(reason):
            return CorruptManifestError(f"ref entry {reason}", key=key)

        doc = open_sealed(raw, bad)
        if set(doc) != _FIELDS or doc["ref"] != name or doc["seq"] != seq:
            raise bad("does not belong at this key (fields, ref name or sequence number differ)")
        step = doc["step"]
        if step is not None and not _is_step(step):
            raise bad(f"holds an invalid step {step!r}")
        return RefState(name, step, seq, doc["checksum"], doc["replaces"])

    def _legacy(self, name: str) -> RefState:
        key = legacy_key(name)
        raw = self.io.get(key, limit=MAX_DOCUMENT_BYTES)
        if raw is None:
            return RefState(name, None)
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or set(doc) != {"step"} or not _is_step(doc["step"]):
                raise ValueError(f"expected {{'step': n}}, got {doc!r:.80}")
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptManifestError(f"ref is damaged: {e}", key=key) from None
        return RefState(name, check_step(doc["step"]))

    # -- moving ---------------------------------------------------------------------

    def move(self, expected: RefState, step: int | None) -> RefState:
        """Point the ref at ``step`` (None: delete it) if it still is as ``expected`` was read.

        Raises
        ------
        RefMovedError
            The ref moved since ``expected`` was read; nothing changed; ``head``
            is its step now.
        """
        name, seq = expected.name, expected.seq + 1
        body = {
            "ref": name,
            "seq": seq,
            "step": step,
            "replaces": expected.checksum,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"),
        }
        data = seal(body)
        try:
            self.io.create(entry_key(name, seq), data)
        except FileExistsError:
            raise self._moved(expected) from None
        mine = RefState(name, step, seq, json.loads(data)["checksum"], expected.checksum)
        if any(s > seq for s in self._seqs(name)):
            # someone built on our entry, or our number had been compacted away under a
            # very stale read and our entry lies below the head (inert)
            above = self._entry(name, seq + 1)
            if above is None or above.replaces != mine.checksum:
                raise self._moved(expected)
        if seq and seq % KEEP == 0:
            self.io.delete_many([entry_key(name, s) for s in self._seqs(name) if s < seq - KEEP])
        return mine

    def check(self, expected: RefState) -> None:
        """Raise :class:`RefMovedError` if the ref is no longer as ``expected`` was read (one LIST, no write)."""
        seqs = self._seqs(expected.name)
        if (seqs[-1] if seqs else -1) != expected.seq:
            raise self._moved(expected)

    def _moved(self, expected: RefState) -> RefMovedError:
        now = self.read(expected.name)
        was = "absent" if expected.step is None else f"at step {expected.step}"
        nowtxt = "was deleted" if now.step is None else f"is at step {now.step}"
        return RefMovedError(
            f"ref {expected.name!r} moved: it was {was} when read and {nowtxt} now (another writer); "
            "nothing was moved: re-read it and retry on the new head",
            head=now.step,
            key=now.key,
        )

    # -- checking ---------------------------------------------------------------------

    def problems(self) -> dict[str, list[CorruptManifestError]]:
        """Per ref name: its damaged entries and every broken link of its hash chain (empty list: sound)."""
        out: dict[str, list[CorruptManifestError]] = {}
        for name, seqs in sorted(self._listing().items()):
            errors = out.setdefault(name, [])
            states = {}
            for seq in seqs:
                try:
                    state = self._entry(name, seq)
                except CorruptManifestError as e:
                    errors.append(e)
                    continue
                if state is not None:
                    states[seq] = state
            for seq, state in states.items():
                prev = states.get(seq - 1)
                if prev is not None and state.replaces != prev.checksum:
                    errors.append(
                        CorruptManifestError(
                            f"ref entry does not follow entry {seq - 1} (log altered?)", key=entry_key(name, seq)
                        )
                    )
            if not seqs:
                try:
                    self._legacy(name)
                except CorruptManifestError as e:
                    errors.append(e)
        return out


def _is_step(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_STEP
