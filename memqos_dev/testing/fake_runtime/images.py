"""The fake runtime's ImageService calls (containerd's image_*.go) on its image store."""
from __future__ import annotations

import hashlib

from shim.cri import pb
from memqos_dev.testing.fake_runtime import gojson, records
from memqos_dev.testing.fake_runtime.errors import UNKNOWN, CriError
from memqos_dev.testing.fake_runtime.records import SNAPSHOTTER_MOUNT
from memqos_dev.testing.fake_runtime.state import RuntimeState


class ImageCalls(RuntimeState):
    """ListImages, ImageStatus, PullImage, RemoveImage and ImageFsInfo."""

    def _list_images(self, req: pb.ListImagesRequest) -> pb.ListImagesResponse:
        """ListImages: every image; containerd (1.6/1.7) ignores the filter ("TODO: Add image
        list filters after CRI defines this more clear")."""
        return pb.ListImagesResponse(images=[i.to_cri() for i in self.images.values()])

    def _image_status(self, req: pb.ImageStatusRequest) -> pb.ImageStatusResponse:
        """ImageStatus: an image unknown locally -> OK with an empty response (image unset),
        not NOT_FOUND (image_status.go). ``verbose`` adds info["info"] {chainID, imageSpec}."""
        image = self._resolve_image(req.image.image)
        if image is None:
            return pb.ImageStatusResponse()
        resp = pb.ImageStatusResponse(image=image.to_cri())
        if req.verbose:
            chain = "sha256:" + hashlib.sha256(("chain:" + image.id).encode()).hexdigest()
            resp.info["info"] = gojson.dumps(
                {
                    "chainID": chain,
                    "imageSpec": {
                        "architecture": "amd64",
                        "os": "linux",
                        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
                        "rootfs": {"type": "layers", "diff_ids": [chain]},
                    },
                }
            )
        return resp

    def _pull_image(self, req: pb.PullImageRequest) -> pb.PullImageResponse:
        """PullImage: adds the image (normalised reference as repo tag, a synthetic repo
        digest) and answers image_ref = the image id, as containerd does. Use ``delays`` to
        simulate a slow pull and ``fail`` for a failing one."""
        if not req.image.image:
            raise CriError(UNKNOWN, 'failed to pull and unpack image "": invalid reference format')
        image = self._add_image(req.image.image)
        return pb.PullImageResponse(image_ref=image.id)

    def _remove_image(self, req: pb.RemoveImageRequest) -> pb.RemoveImageResponse:
        """RemoveImage: removes the image (all its references); unknown -> OK (image_remove.go)."""
        image = self._resolve_image(req.image.image)
        if image is not None:
            self.images.pop(image.id, None)
        return pb.RemoveImageResponse()

    def _image_fs_info(self, req: pb.ImageFsInfoRequest) -> pb.ImageFsInfoResponse:
        """ImageFsInfo: one image filesystem (the overlayfs snapshotter root), as in the traces."""
        resp = pb.ImageFsInfoResponse()
        fs = resp.image_filesystems.add()
        fs.timestamp = records.now_ns()
        fs.fs_id.mountpoint = SNAPSHOTTER_MOUNT
        fs.used_bytes.value = sum(i.size for i in self.images.values())
        fs.inodes_used.value = 100 * len(self.images)
        return resp
