"""The state every CRI call of the fake runtime works on, and the record operations they share."""
from __future__ import annotations

import hashlib
import posixpath
import shutil
import threading
from typing import Any, Callable

from google.protobuf.message import Message

from shim.cri import pb
from memqos_dev.testing.fake_runtime import records
from memqos_dev.testing.fake_runtime.errors import NOT_FOUND, CriError, IdLookupError, filter_id, labels_match, truncindex_get
from memqos_dev.testing.fake_runtime.records import SIGKILL_EXIT_CODE, SYSTEMD, Container, Image, Sandbox, normalize_image_ref
from memqos_dev.testing.fake_runtime.resources import container_cgroup, write_cgroup


class RuntimeState:
    """The fake runtime's stores and knobs (set by FakeRuntime.__init__) and the operations on
    its records that several calls share: id lookups, image resolution, a container's exit and
    its cgroup, a sandbox's stop. The call handlers are mixins of this class."""

    lock: threading.RLock
    cgroup_driver: str
    cgroup_root: str | None
    strict_images: bool
    idempotent_stop: bool
    swap_controller: bool
    hugetlb_controller: bool
    sandbox_image: str
    runtime_handlers: set[str]
    exec_sync_result: tuple[bytes, bytes, int]
    exec_sync_output: Callable[[list[str]], tuple[bytes, bytes, int] | None] | None
    sandboxes: dict[str, Sandbox]
    containers: dict[str, Container]
    images: dict[str, Image]
    _sandbox_names: dict[str, str]
    _container_names: dict[str, str]
    _next_pid: int
    _next_ip: int

    def _pid(self) -> int:
        self._next_pid += 1
        return self._next_pid

    def _find(self, store: dict, key: str, prefix: str):
        """The record of ``store`` named by an id or unique prefix; CriError "<prefix>: <why>"."""
        try:
            return store[truncindex_get(store, key)]
        except IdLookupError as exc:
            raise CriError(exc.code, f"{prefix}: {exc.text}") from None

    def _find_or_none(self, store: dict, key: str, prefix: str, *, missing_ok: bool):
        """As ``_find``, but None for an id no record has when ``missing_ok`` (the idempotent
        Remove calls, and Stop calls with ``idempotent_stop``); an empty or ambiguous key still fails."""
        try:
            return self._find(store, key, prefix)
        except CriError as err:
            if err.code == NOT_FOUND and missing_ok:
                return None
            raise

    def _find_sandbox(self, key: str, prefix: str) -> Sandbox:
        return self._find(self.sandboxes, key, prefix)

    def _find_container(self, key: str, prefix: str) -> Container:
        return self._find(self.containers, key, prefix)

    def _sandboxes_matching(self, f: Message | None, state: int | None) -> list[Sandbox]:
        """The sandboxes a list filter selects (containerd's filterCRISandboxes): id (full or
        unique prefix) and label_selector of ``f`` (None: no filter), and ``state`` if not None."""
        want_id = filter_id(self.sandboxes, f.id) if f is not None and f.id else ""
        return [
            sb for sb in self.sandboxes.values()
            if (state is None or sb.state == state)
            and not (want_id and sb.id != want_id)
            and (f is None or labels_match(sb.config.labels, f.label_selector))
        ]

    def _containers_matching(self, f: Message | None, state: int | None) -> list[Container]:
        """The containers a list filter selects (containerd's filterCRIContainers): id and
        pod_sandbox_id (full or unique prefixes) and label_selector of ``f`` (None: no filter),
        and ``state`` if not None."""
        want_id = want_sb = ""
        if f is not None:
            want_id = filter_id(self.containers, f.id) if f.id else ""
            want_sb = filter_id(self.sandboxes, f.pod_sandbox_id) if f.pod_sandbox_id else ""
        return [
            c for c in self.containers.values()
            if (state is None or c.state == state)
            and not (want_id and c.id != want_id)
            and not (want_sb and c.pod_sandbox_id != want_sb)
            and (f is None or labels_match(c.config.labels, f.label_selector))
        ]

    def _resolve_image(self, ref: str) -> Image | None:
        """containerd's localResolve: an image id, a (normalised) reference, or an id prefix."""
        if not ref:
            return None
        if ref in self.images:
            return self.images[ref]
        try:
            normalized = normalize_image_ref(ref)
        except Exception:  # pragma: no cover - defensive
            normalized = ""
        for image in self.images.values():
            if normalized in image.repo_tags or normalized in image.repo_digests:
                return image
        hex_part = ref[len("sha256:"):] if ref.startswith("sha256:") else ref
        if hex_part and all(ch in "0123456789abcdef" for ch in hex_part):
            matches = [i for i in self.images.values() if i.id[len("sha256:"):].startswith(hex_part)]
            if len(matches) == 1:
                return matches[0]
        return None

    def _add_image(self, ref: str, *, id: str | None = None, size: int = 3_000_000) -> Image:
        existing = self._resolve_image(ref)
        if existing is not None:
            return existing
        normalized = normalize_image_ref(ref)
        image_id = id or "sha256:" + hashlib.sha256(("image:" + normalized).encode()).hexdigest()
        repo = normalized.split("@", 1)[0]
        if ":" in repo.rsplit("/", 1)[-1]:
            repo = repo.rsplit(":", 1)[0]
        digest = "sha256:" + hashlib.sha256(("manifest:" + normalized).encode()).hexdigest()
        image = self.images.get(image_id)
        if image is None:
            image = Image(id=image_id, size=size)
            self.images[image_id] = image
        if "@" not in normalized and normalized not in image.repo_tags:
            image.repo_tags.append(normalized)
        if f"{repo}@{digest}" not in image.repo_digests:
            image.repo_digests.append(f"{repo}@{digest}")
        return image

    def cgroup_dir(self, c: Container) -> str | None:
        """The container's cgroup directory under ``cgroup_root`` (None without one)."""
        if self.cgroup_root is None:
            return None
        rel = container_cgroup(c.sandbox_config.linux.cgroup_parent, c.id, self.cgroup_driver, self.cgroup_prefix)
        return posixpath.join(self.cgroup_root, rel)

    def _write_cgroup(self, c: Container, *, create: bool) -> None:
        write_cgroup(self.cgroup_dir(c), c.resources, create=create, kernel_files=self.kernel_files)

    def _remove_cgroup(self, c: Container) -> None:
        try:
            d = self.cgroup_dir(c)
        except ValueError:
            return
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    def _finish(self, c: Container, exit_code: int, *, reason: str = "", message: str = "") -> None:
        if self.cgroup_root is not None and c.pid:
            self._remove_cgroup(c)  # the task is deleted when it exits: runc removes the cgroup
        c.finished_at = records.now_ns()
        c.exit_code = exit_code
        c.reason = reason
        c.message = message
        c.pid = 0

    def _stop_container_record(self, c: Container, timeout: int) -> None:
        """containerd's stopContainer: only RUNNING containers are acted on.

        A graceful stop (timeout > 0) is modelled as the process exiting 0 on SIGTERM (what
        the traced busybox containers did: reason Completed); timeout 0 is SIGKILL: 137.
        """
        if c.state != pb.CONTAINER_RUNNING:
            return
        self._finish(c, 0 if timeout > 0 else SIGKILL_EXIT_CODE)

    def _stop_sandbox_record(self, sb: Sandbox) -> None:
        """containerd's stopPodSandbox: force-stop (timeout 0) its containers, then the sandbox."""
        for c in self.containers.values():
            if c.pod_sandbox_id == sb.id:
                self._stop_container_record(c, 0)
        sb.state = pb.SANDBOX_NOTREADY
        sb.pid = 0

    def _delete_container_record(self, c: Container) -> None:
        self.containers.pop(c.id, None)
        if self._container_names.get(c.name) == c.id:
            del self._container_names[c.name]

    def _runtime_options(self) -> dict[str, Any]:
        return {"systemd_cgroup": True} if self.cgroup_driver == SYSTEMD else {}
