# Image that runs the shim: the NRI DaemonSet's (deploy/kubernetes), or in proxy mode a podman
# container under systemd beside the kubelet (deploy/memqos-shim-podman.service, with every
# mount it needs); docs/install.md, "The container image".
# BASE: any image with python3 (>= 3.10) and its venv module. The default is the public one;
# scripts/build-image builds on a Debian bookworm base made locally with mmdebstrap.
# The shim and its runtime dependencies live in a venv at /opt/memqos-shim, first in PATH, so
# `memqos-shim` and `python` (the probes' `python -m shim.evidence.health`) are the venv's on
# either base, and a base whose system Python is externally managed (Debian) is left alone.
ARG BASE=python:3.11-slim
# PIP_CERT: a CA bundle for pip (scripts/build-image mounts the host's for the build only).

# The runtime wheel only, without extras: no grpcio, no test or bench code.
FROM ${BASE} AS wheel
ARG PIP_CERT
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shim ./shim
RUN python3 -m venv /build && /build/bin/pip wheel --no-cache-dir --no-deps -w /dist .

FROM ${BASE}
ARG PIP_CERT
COPY --from=wheel /dist /dist
RUN python3 -m venv /opt/memqos-shim \
    && /opt/memqos-shim/bin/pip install --no-cache-dir /dist/memqos_shim-*.whl && rm -rf /dist
ENV PATH=/opt/memqos-shim/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN python -c "import shim.cri; from google.protobuf.internal import api_implementation as a; assert a.Type() == 'upb'" \
    && ! python -c "import grpc" 2>/dev/null && memqos-shim --help >/dev/null
ENTRYPOINT ["memqos-shim"]
CMD ["serve", "--config", "/etc/memqos-shim/config.yaml"]
