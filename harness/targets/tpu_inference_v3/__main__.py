"""``python -m rpa_harness.targets.tpu_inference_v3 REPRO.json``: replays a v3 repro (``main``)."""

import sys

from rpa_harness.targets.tpu_inference_v3 import main

sys.exit(main())
