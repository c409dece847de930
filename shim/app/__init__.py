"""App: the settings (one options table, a typed frozen Config), the wiring of the running shim
from them (service.py) and the `memqos-shim` command line (cli.py)."""
