"""What the tests, the benchmarks and scripts/* need beside the runtime package: stand-ins for
the world around the shim (``memqos_dev.testing``) and the measurements (``memqos_dev.tools``).
Not in the wheel; it resolves paths inside the checkout. scripts/setup puts the checkout on the
virtual environment's path."""
