# The numbers and the table-entry layout that the compiled kernels share with the
# NumPy twin, declared once for Cython (included by _kernels.pyx).
#
# The twin is the executable specification and must import without a compiler,
# so its side of each number lives in Python (_format.LANES, _rans_tables.SCALE_BITS,
# STATE_LOW, STATE_BITS, ENC_ENTRY).  The compiled module exports this side as
# ``CONSTANTS`` and tests/codec/test_backends.py holds every built backend to the
# twin's values: neither side can drift without a failing test.

cdef enum:
    LANES = 4  # interleaved rANS states; element i uses lane i % 4
    STATE_LOW = 1 << 15  # L: every lane state lives in [L, 2**STATE_BITS)
    STATE_BITS = 31  # the reciprocal division is exact only for states < 2**31
    SCALE_BITS = 12  # format version 1 codes every blob at probability scale 2**12
    SCALE = 1 << SCALE_BITS


cdef packed struct EncEntry:
    # one per symbol; the twin's numpy dtype is ``_rans_tables.ENC_ENTRY``
    uint64_t rcp     # ceil(2**shift / f): x // f == (x * rcp) >> shift for x < 2**31
    uint32_t xmax    # f << (31 - S): emit 16 bits first when x >= xmax
    uint16_t start   # cumulative frequency below the symbol
    uint16_t shift


cdef EncEntry _entry

#: The constants above, for the tests that compare them with the twin's.
CONSTANTS = {
    "LANES": LANES,
    "STATE_LOW": STATE_LOW,
    "STATE_BITS": STATE_BITS,
    "SCALE_BITS": SCALE_BITS,
    # (field, byte offset, byte size) of EncEntry, and its total size
    "ENC_ENTRY": (
        ("rcp", <char*>&_entry.rcp - <char*>&_entry, sizeof(_entry.rcp)),
        ("xmax", <char*>&_entry.xmax - <char*>&_entry, sizeof(_entry.xmax)),
        ("start", <char*>&_entry.start - <char*>&_entry, sizeof(_entry.start)),
        ("shift", <char*>&_entry.shift - <char*>&_entry, sizeof(_entry.shift)),
    ),
    "ENC_ENTRY_SIZE": sizeof(EncEntry),
}
