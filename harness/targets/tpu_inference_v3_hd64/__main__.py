"""``python -m rpa_harness.targets.tpu_inference_v3_hd64 REPRO.json``: replays a repro (``main``)."""

import sys

from rpa_harness.targets.tpu_inference_v3_hd64 import main

sys.exit(main())
