"""The command line, ``memqos-shim``: above both the service (``shim.app``) and the operator's
tools (``shim.tools``), whose commands it puts together."""
