"""Collection rules for the whole checkout (pytest reads this before tests/conftest.py).

The vLLM backend's modules import vllm at module level: without the ``vllm`` extra their doctests
cannot be collected, and the backend's tests skip with a reason (tests/integrations).
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["ulstore/integrations/vllm/*.py"]
