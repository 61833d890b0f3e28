"""Imported last by the test forkservers (:func:`support.pd_helpers.mp_context`, ``hf_context``): what the
server preloaded is frozen out of the cyclic collector's reach, in it and in every child forked from it (see
``pytest_collection_finish`` in ``tests/conftest.py``)."""

import gc

gc.freeze()
