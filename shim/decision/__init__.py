"""Decision: pure functions from pod, container and node facts and a policy to the
unified values the shim writes, with the reasons. No I/O."""
from shim.decision.facts import (  # noqa: F401
    OWNED_KEYS,
    REQUESTS_ANNOTATION,
    ContainerFacts,
    Decision,
    NodeFacts,
    PodFacts,
    Policy,
    QoSClass,
    Request,
    RequestSource,
)
from shim.decision.memory import capped_min, decide, headroom, memory_high, protection_key  # noqa: F401
from shim.decision.qos import parse_cgroup_parent, qos_class  # noqa: F401
from shim.decision.request import oom_score_adj_bounds, resolve_request  # noqa: F401
