"""Helpers shared by the test packages (reached through pytest's ``pythonpath = ["."]``).

- :mod:`tests.helpers.bits`: exact bit views, awkward floats (every test that compares values);
- :mod:`tests.helpers.blobs`: resealing a hand-edited ULPack blob;
- :mod:`tests.helpers.http`: a read-only HTTP server answering byte ranges, behind basic auth;
- :mod:`tests.helpers.interleave`: forced interleavings of real processes at one ObjectStore call, and a
  SIGKILL at a child's Nth write; :mod:`tests.helpers.sides`: the other side's operation in a child process
  (``python -m tests.helpers.sides``, or a serving :class:`~tests.helpers.sides.Side`);
- :mod:`tests.helpers.other_side`: a snippet run in a child process at one hooked call (the store's
  concurrency tests); :mod:`tests.helpers.lossy_proxy`: an HTTP proxy that loses one answer;
  :mod:`tests.helpers.maintenance_races`: the roles of the free-running gc/delete/commit/read trials;
- :mod:`tests.helpers.lanes`: whether the slow lane runs (CI), for helpers that do less in the fast lane;
- :mod:`tests.helpers.moto`: a moto S3 server (the ``moto_s3`` fixture of ``tests/conftest.py``);
- :mod:`tests.helpers.small_states`: small states of several chunks per tensor, their children, digests
  (the state machine, ``tests/slow/crash_trials.py``, ``tests/slow/publisher_stress.py``);
- :mod:`tests.helpers.store`: real toytrain trajectories and store checks;
- :mod:`tests.helpers.sync`: sync test helpers; :mod:`tests.helpers.sync_roles`: the trainer and
  follower processes of the end-to-end tests (``python -m tests.helpers.sync_roles``).
"""
