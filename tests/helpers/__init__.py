"""Helpers shared by the test packages (reached through pytest's ``pythonpath = ["."]``).

- :mod:`tests.helpers.bits`: exact bit views, awkward floats (every test that compares values);
- :mod:`tests.helpers.blobs`: resealing a hand-edited ULPack blob;
- :mod:`tests.helpers.http`: a read-only HTTP server answering byte ranges, behind basic auth;
- :mod:`tests.helpers.moto`: a moto S3 server (the ``moto_s3`` fixture of ``tests/conftest.py``);
- :mod:`tests.helpers.store`: real toytrain trajectories and store checks;
- :mod:`tests.helpers.sync`: sync test helpers; :mod:`tests.helpers.sync_roles`: the trainer and
  follower processes of the end-to-end tests (``python -m tests.helpers.sync_roles``).
"""
