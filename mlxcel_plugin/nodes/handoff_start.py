"""How one attempt of a prefill node's handoff starts: transfer choice, header, strategy.

The adaptive selector picks a strategy and codec from the payload and the
target's measured bandwidth; the header names the K/V as they travel (in the
target's dtype where it is narrower than ours: ``decode_targets``, the strategy
casts them, kv_serde/convert.py); the handoff is queued on the target's links.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import Any

from mlxcel_plugin.kv_serde import (
    DEFAULT_MAX_BODY_BYTES,
    SERDE_VERSION,
    HandoffHeader,
    ModelFingerprint,
    SerializableSamplingState,
)
from mlxcel_plugin.kv_serde.convert import cast_fingerprint, casting
from mlxcel_plugin.kv_serde.header import (
    AEAD_ONLY_SERDE_VERSION,
    BODY_CHECKSUM_SERDE_VERSION,
    CHECKSUM_OF_ENCODED,
    CHECKSUM_OF_HELD,
    CHECKSUM_OF_NONE,
    IDENTITY_CODEC,
)
from mlxcel_plugin.kv_serde.versions import LARGE_CHUNK_BYTES, LARGE_CHUNK_SERDE_VERSION
from mlxcel_plugin.nodes.decode_targets import DecodeTargets
from mlxcel_plugin.nodes.handoff_sender import DecodeLinks, OutgoingHandoff
from mlxcel_plugin.nodes.metrics import PrefillMetrics
from mlxcel_plugin.nodes.prefill_job import NodeJob, PrefillNodeParts
from mlxcel_plugin.transfer import (
    AdaptiveSelector,
    BandwidthEstimator,
    TransferChoice,
    make_strategy,
)

logger = logging.getLogger(__name__)


class HandoffStarter:
    """Starts handoff attempts for a prefill node; keeps the bandwidth it learns from them."""

    def __init__(self, parts: PrefillNodeParts, links: DecodeLinks, targets: DecodeTargets,
                 fingerprint: ModelFingerprint, encoder: Executor, metrics: PrefillMetrics,
                 node_id: str):
        self.parts, self.links, self.targets = parts, links, targets
        self.fingerprint, self.encoder, self.metrics = fingerprint, encoder, metrics
        self.node_id = node_id
        self.selector = AdaptiveSelector(parts.transfer_config, parts.strategies, parts.codecs)
        self.bandwidth = BandwidthEstimator()
        self.last_choice: dict[str, Any] | None = None
        # The newest ack's reader_busy_share (link/read_load.py): how the last handoff was paced.
        self.last_reader_busy_share: float | None = None

    def record_choice(self, job: NodeJob, choice: Any, header: HandoffHeader,
                      chunk_bytes: int) -> None:
        """Make the adaptive choice and the estimate behind it visible: log, metric, health."""
        self.last_choice = {**choice.as_dict(), "target": job.target,
                            "checksum_of": header.checksum_of, "chunk_bytes": chunk_bytes,
                            "serde_version": header.wire_version}
        self.metrics.handoff_choices.labels(strategy=choice.strategy, codec=choice.codec).inc()
        logger.debug("%s: handoff %s -> %s: %s", self.node_id, job.request_id, job.target,
                     self.last_choice)


    def header(self, job: NodeJob, epoch: int, first_token: int, codec: str,
               version: int = SERDE_VERSION) -> HandoffHeader:
        return HandoffHeader(
            request_id=job.request_id, handoff_id=job.handoff_id, epoch=epoch,
            fingerprint=cast_fingerprint(self.fingerprint, self.wire_dtype(job.target)),
            prompt_length=len(job.request.prompt_tokens),
            first_token=first_token, sampling=SerializableSamplingState.from_request(job.request),
            deadline_in_s=self.parts.transfer_config.transfer_timeout_s,
            prefix_tokens=job.prefix_tokens, checksum_of=self.checksum_of(job.target, codec),
            version=version,
        )

    def wire_dtype(self, target: str) -> str:
        return self.targets.wire_dtype(target, self.fingerprint.dtype,
                                       self.fingerprint.cache_classes)

    def checksum_of(self, target: str, codec: str) -> str:
        """A lossy codec's checksums cover the bodies sent, where the target reads that: the
        sender then skips decoding its own output, and nodes rounding floats differently agree.
        Raw bodies carry none where the target reads that: AES-GCM authenticates them."""
        if codec == IDENTITY_CODEC and self.links.speaks(target, AEAD_ONLY_SERDE_VERSION):
            return CHECKSUM_OF_NONE
        chosen = self.parts.codecs.get(codec)
        lossy = chosen is not None and not chosen.lossless
        if lossy and self.links.speaks(target, BODY_CHECKSUM_SERDE_VERSION):
            return CHECKSUM_OF_ENCODED
        return CHECKSUM_OF_HELD

    def chunk_bounds(self, target: str, codec: str) -> tuple[int, int, int]:
        """(chunk_bytes, max_body_bytes, the begin's serde version) of a handoff to
        ``target``: raw chunks up to ``LARGE_CHUNK_BYTES`` where it announced
        ``LARGE_CHUNK_SERDE_VERSION`` (an 8B model's 16 MiB tensor in one chunk, not three),
        else within one record; coded chunks keep to ``record_chunk_bytes`` (their size is
        the codec pipeline's fill: transfer/config.py)."""
        config = self.parts.transfer_config
        if codec == IDENTITY_CODEC and self.links.speaks(target, LARGE_CHUNK_SERDE_VERSION):
            return config.chunk_bytes, LARGE_CHUNK_BYTES, LARGE_CHUNK_SERDE_VERSION
        return config.record_chunk_bytes, DEFAULT_MAX_BODY_BYTES, SERDE_VERSION

    def select(self, job: NodeJob, streaming: bool) -> TransferChoice:
        payload = self.fingerprint.kv_bytes(len(job.request.prompt_tokens) - job.prefix_tokens)
        return self.selector.select(payload, self.bandwidth.estimate(job.target),
                                    lanes_available=self.parts.transfer_config.parallelism,
                                    can_stream=streaming,
                                    paced_by=self.bandwidth.paced_by(job.target))

    def begin(self, job: NodeJob, epoch: int, choice: TransferChoice, streaming: bool,
              first_token: int = 0) -> OutgoingHandoff:
        job.choice = choice
        chunk_bytes, body_bound, version = self.chunk_bounds(job.target, choice.codec)
        strategy = make_strategy(choice.strategy, choice.codec,
                                 self.parts.strategies, self.parts.codecs,
                                 chunk_bytes=chunk_bytes, lanes=choice.lanes,
                                 max_body_bytes=body_bound)
        # In the target's dtype where it is narrower (kv_serde/convert.py): a smaller wire.
        strategy = casting(strategy, self.fingerprint.dtype, self.wire_dtype(job.target))
        header = self.header(job, epoch, first_token, choice.codec, version)
        self.record_choice(job, choice, header, chunk_bytes)
        handoff = OutgoingHandoff(header, strategy, job.target, encoder=self.encoder)
        handoff.push(strategy.start(handoff.header))
        self.links.start(handoff, choice.lanes if streaming else 1)
        return handoff
