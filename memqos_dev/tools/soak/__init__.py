"""scripts/soak: the shim under kubelet-shaped load with its runtime killed every few seconds.

The in-repo fake runtime (``memqos_dev.testing.fake_runtime``, without its per-call log: ``upstream.py``)
runs on a unix socket in a temporary directory; ``memqos-shim serve`` runs in front of it with a cgroup tree of plain files and fixed node facts
(``stack.py``). Several clients (grpcio channels like a kubelet's, and the shim's own
``UnaryClient``) drive pods through the shim's socket the way a kubelet does -- RunPodSandbox,
PodSandboxStatus, CreateContainer, ContainerStatus, StartContainer, ListContainers,
ListPodSandbox, UpdateContainerResources, StopContainer, RemoveContainer, StopPodSandbox,
RemovePodSandbox, with status polls -- creating and removing the pod cgroups around them
(``driver.py``). Every ``--kill-every`` seconds the runtime is killed with SIGKILL and started
again on the same socket with empty state.

Each call is classified (``checks.py``): *ok* (the answer parses as the method's response and
says what the runtime's state says: ids, names, the containers listed, and for CreateContainer
and UpdateContainerResources the ``unified`` map the runtime holds equals what
``shim.decision`` computes for the kubelet's request); *unavailable* (UNAVAILABLE while the
runtime was down, or within ``--grace`` seconds after it was back); *stale* (NOT_FOUND for
an object the runtime lost in a restart, which a kubelet sees and re-lists after);
*lost* (no answer within ``--deadline``); *mangled* (anything else). The shim's RSS
(``/proc/PID/status`` VmRSS) is read once ``--warmup`` calls are done and at the end.

Exit status 0 when no call was lost or mangled and RSS grew by less than ``--max-growth-mib``
per 100k calls after warm-up; 1 otherwise (also when the warm-up was never reached, the shim
or the runtime died, or the probes raised). ``--probes`` runs the HTTP/2 limit probes of
``memqos_dev.tools.h2_limits`` (when this tree has them) against the same shim afterwards.
"""
