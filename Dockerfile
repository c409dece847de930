# Image that runs the shim: the NRI DaemonSet's (deploy/kubernetes), or in proxy mode a podman
# container under systemd beside the kubelet (deploy/memqos-shim-podman.service, with every
# mount it needs); docs/install.md, "The container image".
# The runtime wheel only, without extras: no grpcio, no test or bench code.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shim ./shim
RUN pip wheel --no-cache-dir --no-deps -w /dist .

FROM python:3.11-slim
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir /dist/memqos_shim-*.whl && rm -rf /dist \
    && python -c "import shim.cri; from google.protobuf.internal import api_implementation as a; assert a.Type() == 'upb'" \
    && ! python -c "import grpc" 2>/dev/null
ENTRYPOINT ["memqos-shim"]
CMD ["serve", "--config", "/etc/memqos-shim/config.yaml"]
