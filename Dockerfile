# Image that runs the shim. It needs the host's /run (both sockets), /sys/fs/cgroup
# (read-write) and /var/lib/kubelet/config.yaml; see README "Install on a node".
FROM python:3.11-slim
WORKDIR /opt/memqos-shim
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY shim ./shim
RUN pip install --no-cache-dir . && python -c "import shim.cri; from google.protobuf.internal import api_implementation as a; assert a.Type() == 'upb'"
ENTRYPOINT ["memqos-shim"]
CMD ["serve", "--config", "/etc/memqos-shim/config.yaml"]
