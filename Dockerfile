# Image that runs the shim: the NRI DaemonSet's (deploy/kubernetes), or in proxy mode a podman
# container under systemd beside the kubelet (deploy/memqos-shim-podman.service, with every
# mount it needs); docs/install.md, "The container image".
FROM python:3.11-slim
WORKDIR /opt/memqos-shim
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY shim ./shim
RUN pip install --no-cache-dir . && python -c "import shim.cri; from google.protobuf.internal import api_implementation as a; assert a.Type() == 'upb'"
ENTRYPOINT ["memqos-shim"]
CMD ["serve", "--config", "/etc/memqos-shim/config.yaml"]
