"""The one way to the device: the processes the harness starts (``processes``)."""
