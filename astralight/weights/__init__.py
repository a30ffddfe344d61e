"""The weight interface: bf16 bit patterns, the bit-diff delta codec and artifacts.

Typical use::

    # trainer (e.g. the WeightPublisher callback), off the critical path
    builder = ArtifactBuilder("policy", full_every=10)
    art = builder.build(version, model.state_dict())      # full or delta, with its manifest
    for name, data in art.files.items(): client.upload_weight_file("policy", version, name, data)
    client.publish(art.manifest)

    # RaaS weight sync
    ws = WeightState()
    if ws.needs_full(manifest): ...fetch the latest full manifest instead...
    changed = ws.apply(manifest, {name: client.download_weight_file(...) for name in manifest.files})
    engine.update_weights(ws.tensors(changed), manifest.version)

See ``delta.py`` for the blob format; the service keeps the files (``dataflow/weightfiles.py``).
"""

from astralight.weights.artifacts import (
    DELTA_FILE,
    FULL_FILE,
    Artifact,
    ArtifactBuilder,
    WeightState,
    WeightVerificationError,
    apply_delta_artifact,
    build_delta,
    build_full,
    check_delta_artifact,
    read_full,
    state_digest,
    tensor_table,
    verify_files,
    verify_state,
)
from astralight.weights.bf16 import BF16, bits_to_tensor, state_to_bits, tensor_checksum, to_bf16_bits
from astralight.weights.delta import (
    DEFAULT_LEVEL,
    DeltaError,
    DeltaStats,
    apply_delta,
    changed_indices,
    decode_gaps,
    encode_delta,
    encode_gaps,
    read_delta_header,
)

__all__ = [
    "BF16", "DEFAULT_LEVEL", "DELTA_FILE", "FULL_FILE", "Artifact", "ArtifactBuilder", "DeltaError",
    "DeltaStats", "WeightState", "WeightVerificationError",
    "apply_delta", "apply_delta_artifact", "bits_to_tensor", "build_delta", "build_full",
    "changed_indices", "check_delta_artifact", "decode_gaps", "encode_delta", "encode_gaps",
    "read_delta_header", "read_full", "state_digest", "state_to_bits", "tensor_checksum",
    "tensor_table", "to_bf16_bits", "verify_files", "verify_state",
]
